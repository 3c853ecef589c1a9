"""Which reasoning-gym dataset to distil on: held-out accuracy of the real teacher and student on each candidate.

    make real-models && export OPD_MODELS_DIR=~/.cache/real-models
    .venv/bin/python benchmarks/reasoning_task_gap.py --prompts 100 \\
        --datasets basic_arithmetic chain_sum chain_sum:max_terms=3,max_digits=2 leg_counting

Each dataset's held-out prompts are those `trl-opd make-reasoning-task` writes (its held-out seed, 2), with
reasoning-gym's "direct" system prompt, graded by `trl_opd.envs.reasoning.reasoning_gym_reward` (full marks from the
dataset's own `score_answer` on the answer between <answer> tags). Greedy and sampled at temperature 1 from the whole
distribution, with the binomial standard error sqrt(p (1 - p) / n); also the fraction of completions that give a
tagged answer at all, their mean length in tokens, the fraction cut off at `--max-new-tokens`, and a few completions
of each model (the extraction test reads them). The chosen dataset needs a gap of at least 20 points held-out and
completions short enough for a CPU training run.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_opd.envs.addition import completion_texts
from trl_opd.envs.reasoning import extract_answer, reasoning_gym_reward, reasoning_rows
from trl_opd.models_dir import resolve_model
from trl_opd.tools.comparison import describe_machine


def binomial(p: float, n: int) -> dict:
    return {"accuracy": p, "stderr": math.sqrt(p * (1 - p) / n), "n": n}


def measure(texts: list[str], lengths: list[int], solutions: list[str], max_new_tokens: int) -> dict:
    scores = reasoning_gym_reward(texts, solutions)
    n = len(texts)
    return {**binomial(sum(scores) / n, n),
            "tagged": sum(extract_answer(t) is not None for t in texts) / n,
            "mean_tokens": sum(lengths) / n, "truncated": sum(k >= max_new_tokens for k in lengths) / n}


def parse_spec(spec: str) -> tuple[str, dict]:
    """`name` or `name:key=value,key=value` (the dataset's own settings, values as JSON where they parse)."""
    from trl_opd.envs.reasoning import _config_value

    name, _, settings = spec.partition(":")
    return name, dict(_config_value(item) for item in settings.split(",") if item)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_help = "a Hub id (read from its copy in OPD_MODELS_DIR where set) or a directory; default: %(default)s"
    parser.add_argument("--student", default="Qwen/Qwen2.5-Coder-0.5B-Instruct", help=model_help)
    parser.add_argument("--teacher", default="Qwen/Qwen2.5-Coder-1.5B-Instruct", help=model_help)
    parser.add_argument("--datasets", nargs="+", required=True,
                        help="reasoning-gym dataset names, each with its own settings if any: chain_sum:max_terms=3")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--examples", type=int, default=8, help="completions kept per model, dataset and mode")
    parser.add_argument("--json", default="benchmarks/results/reasoning_task_gap.json")
    args = parser.parse_args(argv)

    rows = {spec: reasoning_rows(name, size=args.prompts, seed=2, **config)
            for spec, (name, config) in map(lambda spec: (spec, parse_spec(spec)), args.datasets)}
    results = {"machine": describe_machine(), "date": time.strftime("%Y-%m-%d"), "prompts": args.prompts,
               "max_new_tokens": args.max_new_tokens, "heldout_seed": 2, "models": {}, "datasets": {}}
    for role, model_name in (("student", args.student), ("teacher", args.teacher)):
        path = resolve_model(model_name)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        results["models"][role] = {"model": model_name, "path": str(path)}
        for name, dataset_rows in rows.items():
            prompts, solutions = [r["prompt"] for r in dataset_rows], [r["solution"] for r in dataset_rows]
            entry = results["datasets"].setdefault(name, {})
            for mode in ("greedy", "sampled"):
                start = time.perf_counter()
                texts, lengths = completion_texts(model, tokenizer, prompts, do_sample=mode == "sampled",
                                                  max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                                  with_lengths=True)
                measured = {**measure(texts, lengths, solutions, args.max_new_tokens),
                            "seconds": round(time.perf_counter() - start, 1),
                            "examples": [{"completion": t, "solution": s}
                                         for t, s in zip(texts[: args.examples], solutions, strict=False)]}
                entry[f"{role}_{mode}"] = measured
                print(f"{name:22} {role:8} {mode:8} {measured['accuracy']:6.1%} +- {measured['stderr']:.1%}  "
                      f"tagged {measured['tagged']:4.0%}  {measured['mean_tokens']:4.1f} tokens "
                      f"({measured['truncated']:.0%} cut)  {measured['seconds']} s", flush=True)
        del model
    for name, entry in results["datasets"].items():
        for mode in ("greedy", "sampled"):
            t, s = entry[f"teacher_{mode}"], entry[f"student_{mode}"]
            entry[f"gap_{mode}"] = {"points": 100 * (t["accuracy"] - s["accuracy"]),
                                    "stderr_points": 100 * math.hypot(t["stderr"], s["stderr"])}
        print(f"{name:22} gap greedy {entry['gap_greedy']['points']:5.1f} +- {entry['gap_greedy']['stderr_points']:.1f}"
              f"  sampled {entry['gap_sampled']['points']:5.1f} +- {entry['gap_sampled']['stderr_points']:.1f} points")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
