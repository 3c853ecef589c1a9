"""The real pair's gap on the code-output task: held-out accuracy of the Qwen2.5-Coder 1.5B teacher and 0.5B student.

    make real-models && .venv/bin/trl-opd make-code-task artifacts/code_task
    export OPD_MODELS_DIR=~/.cache/real-models      # offline: where `make real-models` put the Hub's models
    .venv/bin/python benchmarks/real_task_gap.py --prompts 200

Greedy and sampled at temperature 1 (no top-k, no top-p, no repetition penalty: the distribution OPD samples from),
with the binomial standard error sqrt(p (1 - p) / n), and the mean completion length in tokens. The JSON keeps every
number with the machine and date. Both models are Hub ids (`--student`, `--teacher`), read from their copies in
OPD_MODELS_DIR where it is set.
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
from trl_opd.envs.code_output import printed_output_reward
from trl_opd.models_dir import resolve_model
from trl_opd.tools.comparison import describe_machine


def accuracy(texts: list[str], solutions: list[str]) -> dict:
    scores = printed_output_reward([[{"role": "assistant", "content": t}] for t in texts], solutions)
    p = sum(scores) / len(texts)
    return {"accuracy": p, "stderr": math.sqrt(p * (1 - p) / len(texts)), "n": len(texts)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_help = "a Hub id (read from its copy in OPD_MODELS_DIR where set) or a directory; default: %(default)s"
    parser.add_argument("--student", default="Qwen/Qwen2.5-Coder-0.5B-Instruct", help=model_help)
    parser.add_argument("--teacher", default="Qwen/Qwen2.5-Coder-1.5B-Instruct", help=model_help)
    parser.add_argument("--heldout", default="artifacts/code_task/heldout.jsonl")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--json", default="benchmarks/results/real_task_gap.json")
    args = parser.parse_args(argv)

    rows = [json.loads(line) for line in open(args.heldout)][: args.prompts]
    prompts, solutions = [r["prompt"] for r in rows], [r["solution"] for r in rows]
    results = {"machine": describe_machine(), "date": time.strftime("%Y-%m-%d"), "heldout": args.heldout,
               "max_new_tokens": args.max_new_tokens, "models": {}}
    for name, model_name in (("student", args.student), ("teacher", args.teacher)):
        path = resolve_model(model_name)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        results["models"][name] = {"model": model_name, "path": str(path)}
        for mode in ("greedy", "sampled"):
            start = time.perf_counter()
            texts, lengths = completion_texts(model, tokenizer, prompts, do_sample=mode == "sampled",
                                              max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                              with_lengths=True)
            measured = {**accuracy(texts, solutions), "mean_tokens": sum(lengths) / len(lengths),
                        "truncated": sum(n >= args.max_new_tokens for n in lengths) / len(lengths),
                        "seconds": round(time.perf_counter() - start, 1), "example": texts[0]}
            results["models"][name][mode] = measured
            print(f"{name:8} {mode:8} {measured['accuracy']:.1%} +- {measured['stderr']:.1%}"
                  f"  ({measured['mean_tokens']:.1f} tokens, {measured['truncated']:.0%} truncated,"
                  f" {measured['seconds']} s)", flush=True)
        del model
    for mode in ("greedy", "sampled"):
        t, s = results["models"]["teacher"][mode], results["models"]["student"][mode]
        gap = t["accuracy"] - s["accuracy"]
        results[f"gap_{mode}"] = {"points": 100 * gap,
                                  "stderr_points": 100 * math.sqrt(t["stderr"] ** 2 + s["stderr"] ** 2)}
        print(f"gap {mode}: {100 * gap:.1f} +- {results[f'gap_{mode}']['stderr_points']:.1f} points")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
