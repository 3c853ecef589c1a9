"""OPD against TRL's DistillationTrainer, GRPO and SFT on the offline addition task: held-out accuracy and reverse KL
against generated tokens, steps and seconds; seconds per step and peak memory as ratios to DistillationTrainer.

Same student, teacher, prompts, 32 completions per step, learning rate and steps for every method; full fine-tuning;
`trl_opd.comparison.run_method` trains and measures (held-out accuracy and exact KL(student || teacher) on student
samples for 100 held-out prompts, every `--eval-every` steps). Each run is its own process (peak RSS per run); runs
are interleaved (every method once per seed, in turn) so that slow phases of a shared machine hit each alike.

    .venv/bin/python benchmarks/compare_trainers.py --steps 600 --seeds 0 1 \\
        --json benchmarks/results/compare_trainers.json --plot docs/compare_trainers.png
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _fmt(value, spec: str, missing: str = "not reached") -> str:
    return missing if value is None else format(value, spec)


def print_table(runs: list[dict], *, target: float, teacher_accuracy: float, args) -> None:
    from trl_opd.comparison import summarize

    table, halfway = summarize(runs, target=target), summarize(runs, target=0.5)
    reference = table.get("trl-distillation")
    seeds = sorted({run["seed"] for run in runs})
    print(f"\n{args.steps} steps x 32 completions, lr {args.learning_rate:g} unless a method names its own, "
          f"full fine-tune, seeds {seeds}; teacher held-out accuracy {teacher_accuracy:.0%}, target {target:.0%}; "
          f"{os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}\n")
    print("| method | held-out accuracy before -> after | held-out KL before -> after | generated tokens to 50% "
          f"accuracy | generated tokens to {target:.0%} (runs reaching it) | s/step | s/step vs TRL | "
          "peak RSS vs TRL |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for method, row in table.items():
        speed = row["seconds_per_step"] / reference["seconds_per_step"] if reference else None
        memory = row.get("peak_rss_mib", 0) / reference["peak_rss_mib"] if reference else None
        half = halfway[method]
        print(f"| {method} | {row['accuracy_before']:.0%} -> {row['accuracy']:.0%} | "
              f"{row['reverse_kl_before']:.3f} -> {row['reverse_kl']:.3f} | "
              f"{_fmt(half['tokens_to_target'], ',.0f')} ({half['reached']}/{half['seeds']}) | "
              f"{_fmt(row['tokens_to_target'], ',.0f')} ({row['reached']}/{row['seeds']}) | "
              f"{row['seconds_per_step']:.3f} | {_fmt(speed, '.2f', '-')}x | "
              f"{_fmt(memory, '.2f', '-')}x ({row.get('peak_rss_mib', 0):.0f} MiB) |")
    generation = [run["teacher_generation_seconds"] for run in runs if run["teacher_generation_seconds"]]
    if generation:
        print(f"\nSFT's teacher answers took {sum(generation) / len(generation):.0f} s to generate per run "
              "(not in its s/step).")


def main() -> None:
    from trl_opd.comparison import METHODS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="artifacts/tiny_task")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--extra", nargs="*", default=[], metavar="METHOD:LR",
                        help="more runs of a method at another learning rate, e.g. grpo:1e-4")
    parser.add_argument("--json", help="write every run's learning curve here")
    parser.add_argument("--plot", help="write the figure here (PNG)")
    parser.add_argument("--from-json", help="print the table and plot from an earlier --json, without running")
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    from trl_opd.envs.addition import make_tiny_task

    task = make_tiny_task(args.task)
    teacher_accuracy = json.loads((task / "accuracy.json").read_text())["teacher"]["sampled"]
    target = teacher_accuracy - 0.05
    if args.one:
        from trl_opd.comparison import run_method, task_inputs

        method, seed = args.one
        run = run_method(method, **task_inputs(task), steps=args.steps, eval_every=args.eval_every, seed=int(seed),
                         learning_rate=args.learning_rate)
        run["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print("RESULT " + json.dumps(run))
        return

    if args.from_json:
        runs = json.loads(Path(args.from_json).read_text())
    else:
        runs = []
        plan = [(method, args.learning_rate, method) for method in args.methods]
        for extra in args.extra:
            method, learning_rate = extra.split(":")
            plan.append((method, float(learning_rate), f"{method} (lr {float(learning_rate):g})"))
        for seed in args.seeds:
            for method, learning_rate, label in plan:
                command = [sys.executable, __file__, "--task", str(task), "--steps", str(args.steps),
                           "--eval-every", str(args.eval_every), "--learning-rate", str(learning_rate),
                           "--one", method, str(seed)]
                out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
                runs.append({**json.loads(out.split("RESULT ", 1)[1].splitlines()[0]), "method": label})
                last = runs[-1]["history"][-1]
                print(f"{label} seed {seed}: accuracy {last['accuracy']:.2f}, KL {last['reverse_kl_exact']:.3f}, "
                      f"{runs[-1]['seconds_per_step']:.3f} s/step", file=sys.stderr)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(runs, indent=1))
    print_table(runs, target=target, teacher_accuracy=teacher_accuracy, args=args)
    if args.plot:
        from trl_opd.comparison import plot_comparison

        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_comparison(runs, target=target, path=args.plot)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
