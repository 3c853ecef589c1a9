"""The README's picture: held-out accuracy and held-out KL(student || teacher) against training steps for OPD (its
default and its best divergence), TRL's DistillationTrainer, GRPO with the correctness reward and SFT on the teacher's
answers, on the same task and budget, drawn from a committed results file of `benchmarks/compare_trainers.py`.

Each method is shown at its own best learning rate of the sweep the file holds (the best mean final held-out accuracy
over seeds, then the lower KL: the rule of `compare_trainers.py`'s table); a line is the mean over seeds at each
evaluation, the band the range. Reads the JSON only (no model, no torch), so it runs in seconds:

    .venv/bin/python benchmarks/plot_comparison.py \\
        --json benchmarks/results/compare_trainers.json --out docs/comparison.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# method in the results file -> label in the figure; the README's picture shows these five
LABELS = {
    "opd": "OPD, default (full-vocabulary reverse KL)",
    "opd-forward-kl": "OPD, forward KL (its best divergence here)",
    "opd-jsd": "OPD, JSD",
    "opd-sampled": "OPD, sampled-token estimator",
    "trl-distillation": "TRL DistillationTrainer",
    "grpo": "GRPO, correctness reward",
    "sft": "SFT on the teacher's answers",
}
DEFAULT_METHODS = ["opd", "opd-forward-kl", "trl-distillation", "grpo", "sft"]


def best_rates(runs: list[dict]) -> dict[str, float]:
    """Per method, the learning rate with the best mean final held-out accuracy over seeds, then the lower mean KL."""
    finals: dict[tuple[str, float], list[tuple[float, float]]] = {}
    for run in runs:
        last = run["history"][-1]
        finals.setdefault((run["method"], run["learning_rate"]), []).append(
            (last["accuracy"], last["reverse_kl_exact"]))
    best: dict[str, tuple[tuple[float, float], float]] = {}
    for (method, rate), values in finals.items():
        score = (sum(a for a, _ in values) / len(values), -sum(k for _, k in values) / len(values))
        if method not in best or score > best[method][0]:
            best[method] = (score, rate)
    return {method: rate for method, (_, rate) in best.items()}


def curves(runs: list[dict], method: str, rate: float) -> dict[str, list[float]]:
    """Mean, low and high over seeds of accuracy and KL at each evaluation step shared by every seed's run."""
    histories = [run["history"] for run in runs if run["method"] == method and run["learning_rate"] == rate]
    length = min(len(history) for history in histories)
    out: dict[str, list[float]] = {"step": [entry["step"] for entry in histories[0][:length]]}
    for key in ("accuracy", "reverse_kl_exact"):
        columns = [[history[i][key] for history in histories] for i in range(length)]
        out[key] = [sum(column) / len(column) for column in columns]
        out[f"{key}_low"] = [min(column) for column in columns]
        out[f"{key}_high"] = [max(column) for column in columns]
    return out


def plot(runs: list[dict], methods: list[str], path: Path, title: str) -> dict[str, float]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = best_rates(runs)
    fig, (accuracy_axis, kl_axis) = plt.subplots(1, 2, figsize=(12, 4.2))
    for method in methods:
        data = curves(runs, method, rates[method])
        label = f"{LABELS.get(method, method)}, lr {rates[method]:g}"
        line, = accuracy_axis.plot(data["step"], data["accuracy"], marker=".", label=label)
        accuracy_axis.fill_between(data["step"], data["accuracy_low"], data["accuracy_high"], color=line.get_color(),
                                   alpha=0.15, linewidth=0)
        kl_axis.plot(data["step"], data["reverse_kl_exact"], marker=".", color=line.get_color())
        kl_axis.fill_between(data["step"], data["reverse_kl_exact_low"], data["reverse_kl_exact_high"],
                             color=line.get_color(), alpha=0.15, linewidth=0)
    accuracy_axis.set(xlabel="training step (32 completions each)", ylabel="held-out accuracy", ylim=(0, 1))
    kl_axis.set(xlabel="training step (32 completions each)", ylabel="held-out KL(student || teacher)",
                yscale="log")
    for axis in (accuracy_axis, kl_axis):
        axis.grid(alpha=0.3)
    accuracy_axis.legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return {method: rates[method] for method in methods}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="benchmarks/results/compare_trainers.json",
                        help="a results file written by benchmarks/compare_trainers.py --json")
    parser.add_argument("--out", default="docs/comparison.png")
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(LABELS))
    parser.add_argument("--title", default="Addition task (trl-opd make-tiny-task): the same student, teacher, prompts "
                        "and 300 x 32 completions for each method, each at its best learning rate\nmean of seeds 0 "
                        "and 1 (band: their range), 100 held-out prompts every 50 steps; 2-core AMD EPYC, 2026-12-01")
    args = parser.parse_args()
    runs = json.loads(Path(args.json).read_text())
    missing = [method for method in args.methods if method not in {run["method"] for run in runs}]
    if missing:
        parser.error(f"{args.json} has no runs of {missing}")
    rates = plot(runs, args.methods, Path(args.out), args.title)
    print(f"{args.out}: " + ", ".join(f"{method} at lr {rate:g}" for method, rate in rates.items()))


if __name__ == "__main__":
    main()
