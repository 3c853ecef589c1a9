"""OPD against TRL's DistillationTrainer, GRPO and SFT on the offline addition task, each at its own best learning
rate: held-out accuracy and reverse KL against generated tokens, steps and seconds; seconds per step and peak memory
as ratios to DistillationTrainer.

Same student, teacher, prompts, 32 completions per step and steps for every method; full fine-tuning. Every method
runs at each learning rate of its grid (`--learning-rates`, or its own `--method-rates`) on the same seeds; the table
shows each method at the rate with the best mean final held-out accuracy (then the lower KL), and a second table
the whole sweep. `trl_opd.tools.comparison.run_method` trains and measures (held-out accuracy and exact
KL(student || teacher) on student samples for 100 held-out prompts, every `--eval-every` steps). Each run is its own
process (peak RSS per run); runs are interleaved (every method and rate once per seed, in turn) so that slow phases
of a shared machine hit each alike.

    .venv/bin/python benchmarks/compare_trainers.py --steps 300 --seeds 0 1 \\
        --method-rates opd-sampled=1e-4,3e-4,1e-3 grpo=3e-5,1e-4,3e-4 \\
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


def print_tables(runs: list[dict], *, target: float, teacher_accuracy: float, args) -> None:
    from trl_opd.tools.comparison import best_learning_rates, describe_machine, summarize

    rates = best_learning_rates(runs)
    chosen = [run for run in runs if run["learning_rate"] == rates[run["method"]]]
    sweep = summarize([{**run, "method": (run["method"], run["learning_rate"])} for run in runs], target=1.0)
    table, halfway = summarize(chosen, target=target), summarize(chosen, target=0.5)
    reference = table.get("trl-distillation")
    seeds = sorted({run["seed"] for run in runs})
    steps = "/".join(str(steps) for steps in sorted({run["steps"] for run in runs}))  # --from-json: the runs' steps
    print(f"\n{steps} steps x 32 completions, each method at its best learning rate of the sweep below, full "
          f"fine-tuning, mean (range) over seeds {seeds}; teacher held-out accuracy {teacher_accuracy:.0%}, target "
          f"{target:.0%}; {describe_machine()}, {time.strftime('%Y-%m-%d')}\n")
    print("| method | learning rate | held-out accuracy before -> after | held-out KL before -> after | generated "
          f"tokens to 50% accuracy | generated tokens to {target:.0%} (runs reaching it) | s/step | s/step vs TRL | "
          "peak RSS vs TRL |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for method, row in table.items():
        speed = row["seconds_per_step"] / reference["seconds_per_step"] if reference else None
        memory = row.get("peak_rss_mib", 0) / reference["peak_rss_mib"] if reference else None
        half = halfway[method]
        print(f"| {method} | {rates[method]:g} | {row['accuracy_before']:.0%} -> {_spread(row, 'accuracy', '.0%')} | "
              f"{row['reverse_kl_before']:.3f} -> {_spread(row, 'reverse_kl', '.3f')} | "
              f"{_fmt(half['tokens_to_target'], ',.0f')} ({half['reached']}/{half['seeds']}) | "
              f"{_fmt(row['tokens_to_target'], ',.0f')} ({row['reached']}/{row['seeds']}) | "
              f"{row['seconds_per_step']:.3f} | {_fmt(speed, '.2f', '-')}x | "
              f"{_fmt(memory, '.2f', '-')}x ({row.get('peak_rss_mib', 0):.0f} MiB) |")
    generation = [run["teacher_generation_seconds"] for run in chosen if run["teacher_generation_seconds"]]
    if generation:
        print(f"\nSFT's teacher answers took {sum(generation) / len(generation):.0f} s to generate per run "
              "(not in its s/step).")

    print("\nThe sweep (final held-out accuracy and KL, mean (range) over the same seeds; * the rate chosen):\n")
    print("| method | learning rate | held-out accuracy | held-out KL |")
    print("|---|---:|---:|---:|")
    for (method, rate), row in sorted(sweep.items(), key=lambda item: (list(table).index(item[0][0]), item[0][1])):
        mark = " *" if rate == rates[method] else ""
        accuracy, reverse_kl = _spread(row, "accuracy", ".0%"), _spread(row, "reverse_kl", ".3f")
        print(f"| {method} | {rate:g}{mark} | {accuracy} | {reverse_kl} |")


def _spread(row: dict, key: str, spec: str) -> str:
    low, high = row[f"{key}_range"]
    return f"{format(row[key], spec)} ({format(low, spec)}-{format(high, spec)})"


def main() -> None:
    from trl_opd.tools.comparison import METHODS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="artifacts/tiny_task")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--learning-rates", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3],
                        help="every method's grid, unless --method-rates gives it its own")
    parser.add_argument("--method-rates", nargs="*", default=[], metavar="METHOD=LR,LR,...",
                        help="a method's own grid, e.g. grpo=3e-5,1e-4,3e-4")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--json", help="write every run's learning curve here")
    parser.add_argument("--merge", action="store_true", help="add the new runs to those already in --json")
    parser.add_argument("--plot", help="write the figure here (PNG)")
    parser.add_argument("--from-json", help="print the table and plot from an earlier --json, without running")
    parser.add_argument("--one", nargs=3, metavar=("METHOD", "LR", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    from trl_opd.envs.addition import make_tiny_task

    task = make_tiny_task(args.task)
    teacher_accuracy = json.loads((task / "accuracy.json").read_text())["teacher"]["sampled"]
    target = teacher_accuracy - 0.05
    if args.one:
        from trl_opd.tools.comparison import run_method, task_inputs

        method, learning_rate, seed = args.one
        run = run_method(method, **task_inputs(task), steps=args.steps, eval_every=args.eval_every, seed=int(seed),
                         learning_rate=float(learning_rate))
        run["learning_rate"] = float(learning_rate)
        run["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print("RESULT " + json.dumps(run))
        return

    if args.from_json:
        runs = json.loads(Path(args.from_json).read_text())
    else:
        grids = {method: args.learning_rates for method in args.methods}
        for entry in args.method_rates:
            method, _, rates = entry.partition("=")
            if method not in grids:
                parser.error(f"--method-rates {entry}: {method!r} is not one of the methods run ({args.methods})")
            grids[method] = [float(rate) for rate in rates.split(",")]
        runs = json.loads(Path(args.json).read_text()) if args.merge and Path(args.json).exists() else []
        for seed in args.seeds:
            for method, rates in grids.items():
                for learning_rate in rates:
                    command = [sys.executable, __file__, "--task", str(task), "--steps", str(args.steps),
                               "--eval-every", str(args.eval_every), "--one", method, str(learning_rate), str(seed)]
                    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
                    runs.append(json.loads(out.split("RESULT ", 1)[1].splitlines()[0]))
                    last = runs[-1]["history"][-1]
                    print(f"{method} lr {learning_rate:g} seed {seed}: accuracy {last['accuracy']:.2f}, "
                          f"KL {last['reverse_kl_exact']:.3f}, {runs[-1]['seconds_per_step']:.3f} s/step",
                          file=sys.stderr, flush=True)
                    if args.json:  # after every run: a long sweep interrupted keeps what it measured
                        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                        Path(args.json).write_text(json.dumps(runs, indent=1))
    print_tables(runs, target=target, teacher_accuracy=teacher_accuracy, args=args)
    if args.plot:
        from trl_opd.tools.comparison import at_best_rate, plot_comparison

        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_comparison(at_best_rate(runs), target=target, path=args.plot)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
