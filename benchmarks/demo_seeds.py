"""`make demo` over several seeds: the range its held-out accuracy and exact reverse KL end in.

Seed `s` builds the addition task's models with seed `s` (`trl-opd make-tiny-task --seed s`: their initialisation
and SFT; the data is the same for every seed) and runs the demo recipe on them with the recipe's seed plus `s`, each
in its own process as `make demo` runs it (only the paths and the seed overridden): seed 0 is `make demo` itself.
Varying both stands in for what differs between machines of this kind: torch picks different kernels on different
CPUs, so a trajectory on one CPU is, in effect, another seed's trajectory on another.

    .venv/bin/python benchmarks/demo_seeds.py --seeds 0 1 2 3 4   # writes trl_opd/recipes/addition_cpu.seeds.json
    .venv/bin/python benchmarks/demo_seeds.py --from-json          # its table

`trl-opd compare-demo outputs/addition` (`make demo`'s last step) compares one run with the sweep the package ships.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from trl_opd.tools.demo import METRICS, SWEEP, spread

RECIPE = Path("recipes/addition_cpu.yaml")


def run_seed(seed: int, workdir: Path) -> dict:
    recipe = yaml.safe_load(RECIPE.read_text())
    task, output_dir = workdir / f"task-{seed}", workdir / f"demo-{seed}"
    subprocess.run([sys.executable, "-m", "trl_opd", "make-tiny-task", str(task), "--seed", str(seed)], check=True)
    overrides = ["--model_name_or_path", task / "student", "--teacher_model_name_or_path", task / "teacher",
                 "--dataset_name", task / "train.jsonl", "--eval_dataset_name", task / "heldout.jsonl",
                 "--output_dir", output_dir, "--seed", recipe["seed"] + seed]
    begin = time.perf_counter()
    accelerate = Path(sys.executable).parent / "accelerate"
    subprocess.run([str(accelerate), "launch", "--config_file", "recipes/accelerate/cpu.yaml", "-m", "trl_opd",
                    "--config", str(RECIPE), *map(str, overrides)], check=True)
    seconds = time.perf_counter() - begin
    curve = json.loads((output_dir / "heldout_curve.json").read_text())
    task_accuracy = json.loads((task / "accuracy.json").read_text())
    return {"seed": seed, "training_seed": recipe["seed"] + seed, "seconds": seconds, "task": task_accuracy,
            "steps": curve[-1]["step"], **{f"{name}_before": curve[0][name] for name in METRICS},
            **{name: curve[-1][name] for name in METRICS}}


def print_table(sweep: dict) -> None:
    runs = sweep["runs"]
    print(f"\n`make demo` ({sweep['recipe']}, {runs[0]['steps']} steps) over seeds {[run['seed'] for run in runs]}; "
          f"{sweep['machine']}, {sweep['date']}\n")
    print("| seed | student / teacher accuracy as built (sampled) | held-out accuracy before -> after | "
          "held-out reverse KL before -> after | seconds |")
    print("|---:|---:|---:|---:|---:|")
    for run in runs:
        built = f"{run['task']['student']['sampled']:.0%} / {run['task']['teacher']['sampled']:.0%}"
        print(f"| {run['seed']} | {built} | {run['accuracy_before']:.3f} -> {run['accuracy']:.3f} | "
              f"{run['reverse_kl_sampled_before']:.4f} -> {run['reverse_kl_sampled']:.4f} | {run['seconds']:.0f} |")
    for name, (label, spec) in METRICS.items():
        mean, low, high = spread(runs, name)
        print(f"\n{label} after training: mean {mean:{spec}}, range {low:{spec}}-{high:{spec}}", end="")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--workdir", type=Path, default=Path("artifacts/demo_seeds"))
    parser.add_argument("--json", type=Path, default=SWEEP, help="where the sweep is written (or read)")
    parser.add_argument("--from-json", action="store_true", help="print the table of the sweep in --json")
    args = parser.parse_args()

    if not args.from_json:
        from trl_opd.tools.comparison import describe_machine

        sweep = {"recipe": str(RECIPE), "machine": describe_machine(), "date": time.strftime("%Y-%m-%d"), "runs": []}
        for seed in args.seeds:
            sweep["runs"].append(run_seed(seed, args.workdir))
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(sweep, indent=1) + "\n")
    print_table(json.loads(args.json.read_text()))


if __name__ == "__main__":
    main()
