"""Held-out accuracy of tool-using models on the arithmetic tool task, greedy and sampled.

Each held-out question is rolled out the way GRPO's tool loop does it: the model's sampled turn is parsed with the
tokenizer's response template, the tools run, and their results are appended as the template's suffix ids; the final
answer is checked with `trl_opd.envs.final_answer`.

    .venv/bin/python benchmarks/agent_accuracy.py artifacts/tiny_agent/teacher artifacts/tiny_agent/student \
        outputs/agent_tools
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def rollout(model, tokenizer, row: dict, *, do_sample: bool, max_turns: int = 4, max_new_tokens: int = 48) -> list:
    """One multi-turn rollout of `row`: the completion as chat messages (assistant turns and tool results)."""
    import torch
    from trl.chat_template_utils import parse_response

    from trl_opd.envs import ArithmeticToolEnv
    from trl_opd.envs.tiny_agent import loop_chat_template, tool_suffix_ids

    env = ArithmeticToolEnv()
    env.reset(**row)
    tools = [env.add, env.multiply]
    ids = tokenizer.apply_chat_template(row["prompt"], tools=tools, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    messages = []
    for _ in range(max_turns):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=do_sample, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        turn = out[0, len(ids):].tolist()
        message = parse_response(tokenizer, turn, prefix=ids, tools=tools)
        messages.append(message)
        ids = ids + turn
        if not message.get("tool_calls"):
            break
        results = []
        for call in message["tool_calls"]:
            function = call["function"]
            try:
                result = getattr(env, function["name"])(**function["arguments"])
            except Exception as error:  # a malformed call: the tool loop returns the error as the result
                result = {"error": str(error)}
            results.append({"role": "tool", "name": function["name"], "content": str(result)})
        messages += results
        ids = ids + tool_suffix_ids(tokenizer, message, results, loop_chat_template(tokenizer))
    return messages


def accuracy(path: str, rows: list[dict], *, do_sample: bool, seed: int = 0) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_opd.envs import final_answer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    torch.manual_seed(seed)
    correct = [final_answer(rollout(model, tokenizer, row, do_sample=do_sample)) == row["answer"] for row in rows]
    return sum(correct) / len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="model directories (each with its tokenizer)")
    parser.add_argument("--heldout", default="artifacts/tiny_agent/heldout.jsonl")
    parser.add_argument("--n", type=int, default=32)
    args = parser.parse_args()
    rows = [json.loads(line) for line in open(args.heldout)][: args.n]
    print(f"| model | greedy accuracy | sampled accuracy (T=1) |  ({len(rows)} held-out questions)")
    print("|---|---:|---:|")
    for path in args.models:
        greedy, sampled = accuracy(path, rows, do_sample=False), accuracy(path, rows, do_sample=True)
        print(f"| {path} | {greedy:.0%} | {sampled:.0%} |")


if __name__ == "__main__":
    main()
