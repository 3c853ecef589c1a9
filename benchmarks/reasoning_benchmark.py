"""OPD on a reasoning-gym task with the real pair, against every alternative and a control that asks whether the
teacher's signal matters.

    make real-models && export OPD_MODELS_DIR=~/.cache/real-models
    .venv/bin/trl-opd make-reasoning-task artifacts/reasoning_task     # the recipe's task (chain_sum, measured)
    .venv/bin/python benchmarks/reasoning_benchmark.py --seeds 0          # the grid; resumable: runs in --json kept
    .venv/bin/python benchmarks/reasoning_benchmark.py --seeds 1 2 --method-rates opd=3e-4 ...   # at the best rates
    .venv/bin/python benchmarks/reasoning_benchmark.py --timing 8     # each method's step alone, on a quiet machine
    .venv/bin/python benchmarks/reasoning_benchmark.py --from-json benchmarks/results/reasoning_benchmark.json \\
        --plot docs/reasoning_benchmark.png

Every method trains the same student (Qwen2.5-Coder-0.5B-Instruct, a LoRA adapter of rank `--lora-r`) on the same
prompts with the same completions per step, generated-token budget (`--max-completion-length`) and steps
(`trl_opd.tools.comparison.run_method`), each run in its own process (its peak memory):

- `opd`: OPDTrainer's defaults (the exact reverse KL over the whole vocabulary); `opd-forward-kl`, `opd-jsd`: the same
  dense term with the other two divergences; `opd-sampled`: the sampled-token estimator;
- `opd-control`: `opd-sampled` with `opd_constant_advantage` (every sampled token's advantage the constant -mean|A|
  of the batch's teacher advantages: the teacher's scale without its per-token information);
- `trl-distillation`: TRL 1.16's DistillationTrainer on the same pair; `grpo`: GRPO with reasoning-gym's score as
  the reward (groups of `--grpo-generations`); `sft`: SFT on the teacher's sampled answers, whose generation time is
  recorded (`teacher_generation_seconds`) and charged on the wall-clock axis.

Every `--eval-every` steps each student is measured alike on `--eval-prompts` held-out
prompts: accuracy greedy and sampled at temperature 1 (`trl_opd.envs.reasoning.reasoning_gym_reward`), and the exact
KL(student || teacher) on its samples. The teacher and the untrained student are measured the same way once
(`baselines`), and every curve starts from that untrained student (each run's step 0, not measured again: about 40
minutes a run on 2 cores, 27 of them the 60 steps).

Seconds are measured apart from accuracy: a run's held-out accuracy does not depend on what else the machine ran
during it, its wall-clock does (each run records its CPU seconds and the load average). `--timing N` trains each
method at its chosen rate for N steps with nothing measured between them, one method after another on an otherwise
idle machine, and the table's seconds per step and the plot's wall-clock axis are those (`timing`); without them,
the runs' own.

The table shows each method at the learning rate of its grid with the best mean final sampled accuracy
over seeds; the errors are binomial, sqrt(p (1 - p) / n) over all n = prompts x seeds answers, beside the range over
seeds. Picking the best of a grid on the same held-out prompts flatters every method alike (by about one error).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DEFAULT_RATES = {"opd": [1e-4, 3e-4], "opd-forward-kl": [1e-4, 3e-4], "opd-jsd": [1e-4, 3e-4],
                 "opd-sampled": [1e-4, 3e-4], "opd-control": [1e-4, 3e-4], "trl-distillation": [1e-4, 3e-4],
                 "grpo": [1e-4, 3e-4], "sft": [1e-4, 3e-4]}


def _inputs(args):
    from datasets import load_dataset

    from trl_opd.models_dir import resolve_model

    prompts = load_dataset("json", data_files=str(Path(args.task) / "train.jsonl"), split="train")
    heldout = [json.loads(line) for line in open(Path(args.task) / "heldout.jsonl")][: args.eval_prompts]
    return str(resolve_model(args.student)), str(resolve_model(args.teacher)), prompts, heldout


def _run(method: str, learning_rate: float, args, **options) -> dict:
    """`run_method` on the sweep's task and settings, `options` over them."""
    from trl_opd.envs.reasoning import reasoning_gym_reward
    from trl_opd.tools.comparison import run_method

    student, teacher, prompts, heldout = _inputs(args)
    # every run starts from the untrained student that `baselines` measured on the same prompts with the same seed
    # (tests/test_comparison.py: the same numbers): its curve's first point, not measured again
    initial = {k: v for k, v in json.loads(Path(args.json).read_text())["baselines"]["student"].items()
               if k != "seconds"}
    settings = dict(steps=args.steps, batch_size=args.batch_size, learning_rate=learning_rate,
                    eval_every=args.eval_every, eval_prompts=args.eval_prompts,
                    max_completion_length=args.max_completion_length, grpo_generations=args.grpo_generations,
                    accuracy_func=reasoning_gym_reward, lora_r=args.lora_r, initial=initial)
    return run_method(method, student, teacher, prompts, heldout, **{**settings, **options})


def run_one(method: str, learning_rate: float, seed: int, args) -> dict:
    run = _run(method, learning_rate, args, seed=seed, greedy_accuracy=True)
    run.pop("log_history")  # the trainers' own logs: large, and the curve has what the table needs
    usage = resource.getrusage(resource.RUSAGE_SELF)
    # the run's CPU seconds (all its threads) and the machine's load averages at its end: a run that shared the
    # machine took more wall-clock seconds for the same CPU seconds (`--timing` measures each method's step alone)
    return {**run, "learning_rate": learning_rate, "step_0": "the baselines' untrained student",
            "peak_rss_mib": usage.ru_maxrss / 1024, "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "load_average": os.getloadavg()}


def time_one(method: str, learning_rate: float, steps: int, args) -> dict:
    """`method`'s seconds per training step over `steps` steps at `learning_rate`, nothing evaluated between them
    (the untrained student's metrics stand in for the curve's first point), and SFT's teacher seconds per answer."""
    run = _run(method, learning_rate, args, steps=steps, eval_every=steps + 1, seed=0)
    return {"learning_rate": learning_rate, "steps": steps, "seconds_per_step": run["seconds_per_step"],
            "teacher_seconds_per_answer": run["teacher_generation_seconds"] / (steps * args.batch_size),
            "load_average": os.getloadavg()}


def baselines(args) -> dict:
    """The teacher and the untrained student, measured as the trained students are (same prompts, seed, sampling)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_opd.envs.reasoning import reasoning_gym_reward
    from trl_opd.evaluation import heldout_reverse_kl

    student_path, teacher_path, _, heldout = _inputs(args)
    tokenizer = AutoTokenizer.from_pretrained(student_path)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path, dtype=torch.float32).eval()
    student = AutoModelForCausalLM.from_pretrained(student_path, dtype=torch.float32).eval()
    out = {}
    for name, model in (("teacher", teacher), ("student", student)):
        begin = time.perf_counter()
        out[name] = heldout_reverse_kl(model, teacher, tokenizer, [row["prompt"] for row in heldout],
                                       max_new_tokens=args.max_completion_length, seed=1234,
                                       solutions=[row["solution"] for row in heldout],
                                       accuracy_func=reasoning_gym_reward, greedy_accuracy=True)
        out[name]["seconds"] = time.perf_counter() - begin
    return out


def _stderr(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n)


def best_rates(runs: list[dict]) -> dict[str, float]:
    """Per method, the rate with the best mean final sampled accuracy over seeds, then greedy, then the lower KL."""
    finals: dict[tuple[str, float], list[dict]] = {}
    for run in runs:
        finals.setdefault((run["method"], run["learning_rate"]), []).append(run["history"][-1])
    best: dict[str, tuple[tuple, float]] = {}
    for (method, rate), lasts in finals.items():
        mean = {key: sum(last[key] for last in lasts) / len(lasts)
                for key in ("accuracy", "accuracy_greedy", "reverse_kl_exact")}
        score = (mean["accuracy"], mean["accuracy_greedy"], -mean["reverse_kl_exact"])
        if method not in best or score > best[method][0]:
            best[method] = (score, rate)
    return {method: rate for method, (_, rate) in best.items()}


def _timing(results: dict, method: str, rate: float) -> dict | None:
    """`method`'s `--timing` pass, where one was measured at `rate`."""
    timing = results.get("timing", {}).get(method)
    return timing if timing is not None and timing["learning_rate"] == rate else None


def _seconds(results: dict, method: str, group: list[dict]) -> tuple[float, float]:
    """`method`'s seconds per step and SFT's seconds of teacher answers for a run of the sweep's length: from its
    `--timing` pass where one was measured at the chosen rate, else the mean of the runs in `group`."""
    timing = _timing(results, method, group[0]["learning_rate"])
    if timing is not None:
        answers = results["settings"]["steps"] * results["settings"]["batch_size"]
        return timing["seconds_per_step"], timing["teacher_seconds_per_answer"] * answers
    return (sum(run["seconds_per_step"] for run in group) / len(group),
            sum(run["teacher_generation_seconds"] for run in group) / len(group))


def summary(results: dict) -> dict[str, dict]:
    """Per method at its best rate: final accuracies (mean over seeds, binomial error over every answer, range over
    seeds), KL, seconds per step, SFT's generation seconds, and the step at which the mean sampled accuracy first
    closed half the gap from the untrained student to the teacher."""
    runs, base, n = results["runs"], results["baselines"], results["settings"]["eval_prompts"]
    half = (base["student"]["accuracy"] + base["teacher"]["accuracy"]) / 2
    rows = {}
    for method, rate in best_rates(runs).items():
        group = [run for run in runs if run["method"] == method and run["learning_rate"] == rate]
        length = min(len(run["history"]) for run in group)
        row = {"learning_rate": rate, "seeds": sorted(run["seed"] for run in group)}
        for key in ("accuracy", "accuracy_greedy", "reverse_kl_exact"):
            finals = [run["history"][length - 1][key] for run in group]
            row[key] = sum(finals) / len(finals)
            row[f"{key}_range"] = (min(finals), max(finals))
            if key != "reverse_kl_exact":
                row[f"{key}_stderr"] = _stderr(row[key], n * len(group))
        row["seconds_per_step"], row["teacher_generation_seconds"] = _seconds(results, method, group)
        row["peak_rss_mib"] = max(run["peak_rss_mib"] for run in group)
        mean_curve = [(group[0]["history"][i]["step"], sum(run["history"][i]["accuracy"] for run in group) / len(group))
                      for i in range(length)]
        row["steps_to_half_gap"] = next((step for step, accuracy in mean_curve if accuracy >= half), None)
        rows[method] = row
    return rows


def print_table(results: dict) -> None:
    from trl_opd.tools.comparison import describe_machine

    settings, base = results["settings"], results["baselines"]
    n = settings["eval_prompts"]
    rows = summary(results)
    seeds = sorted({seed for row in rows.values() for seed in row["seeds"]})
    print(f"\nreasoning-gym {settings['dataset']}, {settings['steps']} steps x {settings['batch_size']} completions "
          f"of at most {settings['max_completion_length']} tokens, LoRA r {settings['lora_r']}, {n} held-out prompts, "
          f"seeds {seeds}, each method at its best learning rate; {results.get('machine', describe_machine())}, "
          f"{results.get('date', time.strftime('%Y-%m-%d'))}\n")
    print("| method | learning rate | held-out accuracy, sampled (T = 1) | greedy | held-out KL(student \\|\\| "
          "teacher) | steps to half the gap | s/step | peak RSS |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in ("teacher", "student"):
        entry = base[name]
        label = "teacher (1.5B, not trained)" if name == "teacher" else "student (0.5B, untrained)"
        print(f"| {label} | | {entry['accuracy']:.1%} +- {_stderr(entry['accuracy'], n):.1%} | "
              f"{entry['accuracy_greedy']:.1%} +- {_stderr(entry['accuracy_greedy'], n):.1%} | "
              f"{entry['reverse_kl_exact']:.3f} | | | |")

    def spread(row, key, spec=".1%"):
        low, high = row[f"{key}_range"]
        error = f" +- {format(row[f'{key}_stderr'], spec)}" if f"{key}_stderr" in row else ""
        return f"{format(row[key], spec)}{error} ({format(low, spec)}-{format(high, spec)})"

    for method, row in rows.items():
        generation = (f" + {row['teacher_generation_seconds']:.0f} s of teacher answers"
                      if row["teacher_generation_seconds"] else "")
        half = row["steps_to_half_gap"]
        print(f"| {method} | {row['learning_rate']:g} | {spread(row, 'accuracy')} | {spread(row, 'accuracy_greedy')} | "
              f"{spread(row, 'reverse_kl_exact', '.3f')} | {'not reached' if half is None else half} | "
              f"{row['seconds_per_step']:.1f}{generation} | {row['peak_rss_mib'] / 1024:.1f} GiB |")
    print("\nThe sweep (final sampled accuracy, mean over seeds; * the rate chosen):\n")
    chosen = {method: row["learning_rate"] for method, row in rows.items()}
    sweep: dict[tuple[str, float], list[float]] = {}
    for run in results["runs"]:
        sweep.setdefault((run["method"], run["learning_rate"]), []).append(run["history"][-1]["accuracy"])
    for (method, rate), finals in sorted(sweep.items()):
        mark = " *" if chosen[method] == rate else ""
        print(f"- {method} lr {rate:g}{mark}: {sum(finals) / len(finals):.1%} over {len(finals)} seeds")


def plot(results: dict, path: Path, methods: list[str] | None = None) -> None:
    """Mean held-out sampled accuracy against steps and against wall-clock seconds, a band over the seeds' range,
    each method at its best rate; the teacher's and the untrained student's accuracy as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, base, settings = results["runs"], results["baselines"], results["settings"]
    rates = best_rates(runs)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.4), sharey=True)
    for method in methods or list(rates):
        group = [run for run in runs if run["method"] == method and run["learning_rate"] == rates[method]]
        length = min(len(run["history"]) for run in group)
        columns = [[run["history"][i]["accuracy"] for run in group] for i in range(length)]
        steps = [group[0]["history"][i]["step"] for i in range(length)]
        # SFT's clock starts with its teacher's answers, generated before its first step
        if _timing(results, method, rates[method]) is not None:
            per_step, generation = _seconds(results, method, group)
            seconds = [generation + step * per_step for step in steps]
        else:
            seconds = [sum(run["history"][i]["train_seconds"] + run["teacher_generation_seconds"] for run in group)
                       / len(group) for i in range(length)]
        for axis, xs in zip(axes, (steps, seconds), strict=True):
            line, = axis.plot(xs, [sum(c) / len(c) for c in columns], marker=".",
                              label=f"{method}, lr {rates[method]:g}" if axis is axes[0] else None,
                              linestyle="--" if method == "opd-control" else "-")
            axis.fill_between(xs, [min(c) for c in columns], [max(c) for c in columns], color=line.get_color(),
                              alpha=0.15, linewidth=0)
    for axis, label in zip(axes, (f"training step ({settings['batch_size']} completions each)",
                                  "wall-clock seconds (SFT: its teacher's answers first)"), strict=True):
        first = axis is axes[0]
        axis.axhline(base["teacher"]["accuracy"], color="black", linewidth=1, label="teacher" if first else None)
        axis.axhline(base["student"]["accuracy"], color="grey", linewidth=1, linestyle=":",
                     label="untrained student" if first else None)
        axis.set(xlabel=label)
        axis.grid(alpha=0.3)
    axes[0].set(ylabel="held-out accuracy, sampled (T = 1)")
    seeds = sorted({run["seed"] for run in runs})
    fig.suptitle(f"reasoning-gym {settings['dataset']}: Qwen2.5-Coder 0.5B (LoRA) from 1.5B, {settings['steps']} x "
                 f"{settings['batch_size']} completions, each method at its best learning rate; mean of seeds "
                 f"{seeds} (band: range), {settings['eval_prompts']} held-out prompts\n"
                 f"{results.get('machine', '')}, {results.get('date', '')}", fontsize=9)
    axes[0].legend(fontsize=7, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


SETTINGS = ("dataset", "steps", "batch_size", "max_completion_length", "eval_every", "eval_prompts", "lora_r",
            "grpo_generations", "student", "teacher")


def main(argv: list[str] | None = None) -> None:
    from trl_opd.tools.comparison import METHODS, describe_machine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_help = "a Hub id (read from its copy in OPD_MODELS_DIR where set) or a directory; default: %(default)s"
    parser.add_argument("--student", default="Qwen/Qwen2.5-Coder-0.5B-Instruct", help=model_help)
    parser.add_argument("--teacher", default="Qwen/Qwen2.5-Coder-1.5B-Instruct", help=model_help)
    parser.add_argument("--task", default="artifacts/reasoning_task", help="written by trl-opd make-reasoning-task")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--method-rates", nargs="*", default=[], metavar="METHOD=LR,LR,...",
                        help="a method's own learning-rate grid instead of DEFAULT_RATES")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grpo-generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=30)
    parser.add_argument("--eval-prompts", type=int, default=100)
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--json", default="benchmarks/results/reasoning_benchmark.json")
    parser.add_argument("--from-json", help="print the table (and --plot) from an earlier --json, running nothing")
    parser.add_argument("--plot", help="draw the figure here (PNG)")
    parser.add_argument("--timing", type=int, metavar="STEPS",
                        help="measure each method's seconds per step at its chosen rate over STEPS steps (after the "
                        "sweep, on an otherwise idle machine) into --json")
    parser.add_argument("--time-one", nargs=3, metavar=("METHOD", "LR", "STEPS"), help=argparse.SUPPRESS)
    parser.add_argument("--one", nargs=3, metavar=("METHOD", "LR", "SEED"), help=argparse.SUPPRESS)
    parser.add_argument("--baselines-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.one:
        method, rate, seed = args.one
        print("RESULT " + json.dumps(run_one(method, float(rate), int(seed), args)))
        return
    if args.time_one:
        method, rate, steps = args.time_one
        print("RESULT " + json.dumps(time_one(method, float(rate), int(steps), args)))
        return
    if args.baselines_only:
        print("RESULT " + json.dumps(baselines(args)))
        return
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        path = Path(args.json)
        first = json.loads(next(open(Path(args.task) / "heldout.jsonl")))
        args.dataset = json.loads(first["solution"])["metadata"]["source_dataset"]
        settings = {name: getattr(args, name) for name in SETTINGS}
        results = json.loads(path.read_text()) if path.exists() else {"settings": settings, "runs": []}
        if results["settings"] != settings:  # a resumed sweep must be the same experiment
            parser.error(f"{path} holds runs with other settings: {results['settings']}; pass another --json.")
        results.update(machine=describe_machine(), command=" ".join(sys.argv))

        def measure(*flags: str) -> dict:
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], *flags], capture_output=True, text=True)
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                raise SystemExit(f"{' '.join(flags)} failed:\n{out.stderr[-4000:]}")
            return json.loads(lines[-1][len("RESULT "):])

        def save() -> None:  # after every run: an interrupted sweep keeps what it measured, and resumes from it
            results["date"] = time.strftime("%Y-%m-%d")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(results, indent=1) + "\n")

        if "baselines" not in results:
            results["baselines"] = measure("--baselines-only")
            save()
        grids = {method: DEFAULT_RATES[method] for method in args.methods}
        for entry in args.method_rates:
            method, _, rates = entry.partition("=")
            if method not in grids:
                parser.error(f"--method-rates {entry}: {method!r} is not one of the methods run ({args.methods})")
            grids[method] = [float(rate) for rate in rates.split(",")]
        if args.timing:
            for method, rate in best_rates(results["runs"]).items():
                if method in args.methods:
                    results.setdefault("timing", {})[method] = measure("--time-one", method, str(rate),
                                                                       str(args.timing))
                    save()
                    print(f"{method} lr {rate:g}: {results['timing'][method]['seconds_per_step']:.1f} s/step "
                          f"(load {results['timing'][method]['load_average'][0]:.2f})", flush=True)
            args.seeds = []  # timing only
        done = {(run["method"], run["learning_rate"], run["seed"]) for run in results["runs"]}
        for seed in args.seeds:  # every method and rate once per seed, in turn: a slow hour hits each alike
            for method, rates in grids.items():
                for rate in rates:
                    if (method, rate, seed) in done:
                        continue
                    run = measure("--one", method, str(rate), str(seed))
                    results["runs"].append(run)
                    save()
                    last = run["history"][-1]
                    print(f"{method} lr {rate:g} seed {seed}: sampled {last['accuracy']:.1%}, greedy "
                          f"{last['accuracy_greedy']:.1%}, KL {last['reverse_kl_exact']:.3f}, "
                          f"{run['seconds_per_step']:.1f} s/step", flush=True)
    if results["runs"]:
        print_table(results)
    if args.plot:
        plot(results, Path(args.plot))
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
