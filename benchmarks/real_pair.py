"""OPD on the real pair against the alternatives: Qwen2.5-Coder-0.5B-Instruct (LoRA) from the 1.5B on the code task.

    make real-models && .venv/bin/trl-opd make-code-task artifacts/code_task
    export OPD_MODELS_DIR=~/.cache/real-models      # offline: where `make real-models` put the Hub's models
    .venv/bin/python benchmarks/real_pair.py --steps 16 --methods opd trl-distillation

The student and teacher are Hub ids (`--student`, `--teacher`), read from their copies in OPD_MODELS_DIR where it is
set. The same student, teacher, prompts, LoRA (r 8), learning rate, completions per step and steps for every method
(`trl_opd.tools.comparison.run_method`, each in its own process for its peak memory). Held-out accuracy (with its
binomial standard error), greedy and sampled at temperature 1, and exact KL(student || teacher) on the student's samples
for `--eval-prompts` held-out programs, before and after; seconds per step with the held-out evaluations left out, and
each method's against TRL's DistillationTrainer's in the same run.
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


def run_one(method: str, args) -> dict:
    from datasets import load_dataset

    from trl_opd.envs.code_output import printed_output_reward
    from trl_opd.models_dir import resolve_model
    from trl_opd.tools.comparison import run_method

    # resolved in the method's own process, so the JSON the parent writes keeps the names as given
    args.student, args.teacher = resolve_model(args.student), resolve_model(args.teacher)
    prompts = load_dataset("json", data_files=str(Path(args.task) / "train.jsonl"), split="train")
    heldout = [json.loads(line) for line in open(Path(args.task) / "heldout.jsonl")]
    if method == "teacher":
        return evaluate_teacher(args, heldout[: args.eval_prompts], printed_output_reward)
    run = run_method(method, args.student, args.teacher, prompts, heldout, steps=args.steps,
                     batch_size=args.batch_size, learning_rate=args.learning_rate, eval_every=args.steps,
                     eval_prompts=args.eval_prompts, seed=args.seed, max_completion_length=args.max_completion_length,
                     accuracy_func=printed_output_reward, lora_r=args.lora_r, greedy_accuracy=True)
    run["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return run


def evaluate_teacher(args, heldout: list[dict], accuracy_func) -> dict:
    """The teacher measured as the students are (same prompts, seed and sampling): its accuracy is the ceiling."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_opd.evaluation import heldout_reverse_kl

    tokenizer = AutoTokenizer.from_pretrained(args.student)
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).eval()
    metrics = heldout_reverse_kl(teacher, teacher, tokenizer, [row["prompt"] for row in heldout],
                                 max_new_tokens=args.max_completion_length, seed=1234,
                                 solutions=[row["solution"] for row in heldout], accuracy_func=accuracy_func,
                                 greedy_accuracy=True)
    return {"method": "teacher", "history": [{"step": 0, **metrics}],
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _stderr(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n)


def print_table(runs: list[dict], args) -> None:
    from trl_opd.tools.comparison import describe_machine

    by_method = {run["method"]: run for run in runs}
    reference = by_method.get("trl-distillation")
    n = args.eval_prompts
    print(f"\n{args.steps} steps x {args.batch_size} completions, LoRA r {args.lora_r}, lr {args.learning_rate}, "
          f"{n} held-out programs, seed {args.seed}, {describe_machine()}, {time.strftime('%Y-%m-%d')}")
    print("| method | held-out accuracy, greedy: before -> after | sampled (T = 1): before -> after | "
          "held-out KL(student \\|\\| teacher) before -> after | s/step | vs TRL | peak RSS |")
    print("|---|---:|---:|---:|---:|---:|---:|")

    def accuracy(entry: dict, key: str) -> str:
        return f"{entry[key]:.1%} +- {_stderr(entry[key], n):.1%}"

    for run in runs:
        first, last = run["history"][0], run["history"][-1]
        if run["method"] == "teacher":
            print(f"| teacher (not trained) | {accuracy(first, 'accuracy_greedy')} | {accuracy(first, 'accuracy')} | "
                  "0 | | | |")
            continue
        ratio = run["seconds_per_step"] / reference["seconds_per_step"] if reference else float("nan")
        print(f"| {run['method']} | {accuracy(first, 'accuracy_greedy')} -> {accuracy(last, 'accuracy_greedy')} | "
              f"{accuracy(first, 'accuracy')} -> {accuracy(last, 'accuracy')} | {first['reverse_kl_exact']:.3f} -> "
              f"{last['reverse_kl_exact']:.3f} | {run['seconds_per_step']:.1f} | {ratio:.2f}x | "
              f"{run['peak_rss_mib'] / 1024:.1f} GiB |")

def main() -> None:
    from trl_opd.tools.comparison import METHODS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_help = "a Hub id (read from its copy in OPD_MODELS_DIR where set) or a directory; default: %(default)s"
    parser.add_argument("--student", default="Qwen/Qwen2.5-Coder-0.5B-Instruct", help=model_help)
    parser.add_argument("--teacher", default="Qwen/Qwen2.5-Coder-1.5B-Instruct", help=model_help)
    parser.add_argument("--task", default="artifacts/code_task")
    parser.add_argument("--methods", nargs="+", default=["teacher", "opd", "trl-distillation", "opd-sampled"],
                        choices=["teacher", *METHODS], help="'teacher': the teacher evaluated the same way, untrained")
    parser.add_argument("--append", action="store_true",
                        help="keep the runs already in --json (of other methods) and add these")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--eval-prompts", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="benchmarks/results/real_pair.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args)))
        return
    runs = []
    if args.append and Path(args.json).exists():
        runs = [run for run in json.loads(Path(args.json).read_text())["runs"] if run["method"] not in args.methods]
    for method in args.methods:
        command = [sys.executable, __file__, *sys.argv[1:], "--one", method]
        out = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            raise SystemExit(f"{method} failed:\n{out.stderr[-4000:]}")
        runs.append(json.loads(lines[-1][len("RESULT "):]))
        print(f"{method}: {runs[-1].get('seconds_per_step', 0.0):.1f} s/step", flush=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1) + "\n")
    print_table(runs, args)


if __name__ == "__main__":
    main()
