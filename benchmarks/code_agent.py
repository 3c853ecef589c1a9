"""The code tool agent on real models: held-out accuracy through the environment server, for the student before and
after training (OPD from the teacher, or GRPO with the correctness reward on the same rollout budget) and the teacher.

Each held-out program is one episode, rolled out as GRPO's tool loop does it: the model's turn is parsed with the
tokenizer's response template; a `run_python` call goes to the environment server (`OPD_ENV_SERVER_URL`, one
session per episode) and its observation is appended as the chat template's tool-result suffix; the episode ends at
a turn without a tool call, after `--max-tool-calls` calls (the recipe's `max_tool_calling_iterations`), or when a
tool result would pass the completion budget (`--max-completion-length`, the recipe's; the result is dropped, as the
trainer does). The model is served by vLLM's CPU build (`.venv-vllm`), with prefix caching: every prompt opens with
the same tool schema. Greedy, and sampled at temperature 1 (no top-k, top-p or repetition penalty). An episode is
right when its last reply states the output, as its text or its JSON "return" field (`stated_output_reward`, GRPO's
reward too: both models restate the call as JSON after it); `exact` counts replies that are the output alone. The
binomial standard error sqrt(p (1 - p) / n); tool calls per episode; the share of episodes that end with an answer
(a turn without a tool call that is not cut by the budget). A LoRA adapter (`--adapter`) is merged into it first.

    trl-opd serve-env --port 8765 &  export OPD_ENV_SERVER_URL=http://127.0.0.1:8765 OPD_MODELS_DIR=~/.cache/real-models
    .venv/bin/python benchmarks/code_agent.py evaluate Qwen/Qwen2.5-Coder-0.5B-Instruct --json results/student.json
    .venv/bin/python benchmarks/code_agent.py evaluate Qwen/Qwen2.5-Coder-0.5B-Instruct --adapter outputs/opd-s42 ...
    # GRPO on the same budget, TRL's GRPOTrainer with the recipe's settings (4 prompts x 1 rollout per OPD step
    # against 1 prompt x 4 rollouts per GRPO step):
    .venv/bin/python benchmarks/code_agent.py grpo --config recipes/agent_code_env_cpu.yaml --seed 42 --output_dir D
    # the table, one row per method over its seeds:
    .venv/bin/python benchmarks/code_agent.py summary --group "OPD=results/code_agent_opd28_s*.json" --group ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).parents[1]


def rollout(row: dict, index: int, *, tokenizer, complete, do_sample: bool, seed: int, max_completion_length: int,
            max_tool_calls: int) -> dict:
    """One episode of `row` through the environment server: its messages, tool calls and whether it answered."""
    from trl.chat_template_utils import parse_response

    from trl_opd.envs.code_env import CodeToolClient
    from trl_opd.envs.tiny_agent import loop_chat_template, tool_suffix_ids

    environment = CodeToolClient()
    environment.reset(**row)
    tools = [environment.run_python]
    prompt = tokenizer.apply_chat_template(row["prompt"], tools=tools, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    ids, messages, calls, answered = list(prompt), [], 0, False
    chat_template = loop_chat_template(tokenizer)
    for turn in range(max_tool_calls + 1):
        budget = max_completion_length - (len(ids) - len(prompt))
        if budget <= 0:
            break
        sampled, finished = complete(ids, budget, do_sample=do_sample, seed=seed * 1000003 + index * 17 + turn)
        message = parse_response(tokenizer, sampled, prefix=ids, tools=tools)
        messages.append(message)
        ids = ids + sampled
        if not message.get("tool_calls"):
            answered = finished
            break
        if turn == max_tool_calls:
            break  # the trainer's loop calls no more tools: the episode ends with an unanswered call
        results = []
        for call in message["tool_calls"]:
            calls += 1
            function = call.get("function", {})
            try:
                result = getattr(environment, function["name"])(**function["arguments"])
            except Exception as error:  # a malformed call: the tool loop returns the error as the result
                result = {"error": str(error)}
            results.append({"role": "tool", "name": function.get("name"), "content": str(result)})
        suffix = tool_suffix_ids(tokenizer, message, results, chat_template)
        if len(ids) + len(suffix) - len(prompt) > max_completion_length:
            break  # the trainer drops a result that would pass the budget, and the episode ends at the call
        messages += results
        ids = ids + suffix
    return {"messages": messages, "tool_calls": calls, "answered": answered}


def vllm_completer(url: str, model: str, stop_ids: list[int]):
    """`complete(ids, max_tokens, do_sample, seed) -> (sampled ids, ended at a stop token)` against a vLLM server."""
    import requests

    def complete(ids: list[int], max_tokens: int, *, do_sample: bool, seed: int):
        body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 1.0 if do_sample else 0.0,
                "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "seed": seed, "stop_token_ids": stop_ids,
                "skip_special_tokens": False, "return_token_ids": True}
        choice = requests.post(f"{url}/v1/completions", json=body, timeout=600).json()["choices"][0]
        return list(choice["token_ids"]), choice["finish_reason"] == "stop"

    return complete


def binomial(correct: int, n: int) -> dict:
    p = correct / n
    return {"accuracy": p, "stderr": math.sqrt(p * (1 - p) / n), "correct": correct, "n": n}


def evaluate(model_dir: str, rows: list[dict], *, python: str, log: Path, max_completion_length: int,
             max_tool_calls: int, seed: int, workers: int, untagged_tool_calls: bool) -> dict:
    from transformers import AutoTokenizer, GenerationConfig

    from trl_opd.envs.code_output import printed_output_reward, stated_output_reward
    from trl_opd.tools.testing import TeacherServerProcess
    from trl_opd.trainer.multiturn import set_tool_call_parser

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    set_tool_call_parser(tokenizer, SimpleNamespace(untagged_tool_calls=untagged_tool_calls), multi_turn=True)
    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id  # the model's own stop tokens, as generate uses
    stops = sorted({tokenizer.eos_token_id, *([eos] if isinstance(eos, int) else eos or [])})
    report = {}
    server = TeacherServerProcess(model_dir, log, python, max_model_len=1024,
                                  extra=("--enable-prefix-caching", "--max-num-seqs", str(workers)))
    with server:
        complete = vllm_completer(server.url, str(model_dir), stops)
        for mode, do_sample in (("greedy", False), ("sampled", True)):
            start = time.monotonic()
            episode = partial(rollout, tokenizer=tokenizer, complete=complete, do_sample=do_sample, seed=seed,
                              max_completion_length=max_completion_length, max_tool_calls=max_tool_calls)
            with ThreadPoolExecutor(workers) as pool:
                episodes = list(pool.map(episode, rows, range(len(rows))))
            replies, solutions = [e["messages"] for e in episodes], [row["solution"] for row in rows]
            report[mode] = {
                **binomial(int(sum(stated_output_reward(replies, solutions))), len(rows)),
                "exact": binomial(int(sum(printed_output_reward(replies, solutions))), len(rows)),
                "tool_calls_per_episode": sum(e["tool_calls"] for e in episodes) / len(rows),
                "episodes_with_a_tool_call": sum(e["tool_calls"] > 0 for e in episodes) / len(rows),
                "episodes_ending_with_an_answer": sum(e["answered"] for e in episodes) / len(rows),
                "seconds": round(time.monotonic() - start, 1),
                "examples": [e["messages"] for e in episodes[:3]],
            }
            print(f"{mode}: {report[mode]['accuracy']:.1%} +- {report[mode]['stderr']:.1%}, "
                  f"{report[mode]['tool_calls_per_episode']:.2f} tool calls per episode, "
                  f"{report[mode]['episodes_ending_with_an_answer']:.0%} end with an answer, "
                  f"{report[mode]['exact']['accuracy']:.0%} reply with the output alone "
                  f"({report[mode]['seconds']} s)", flush=True)
    return report


def merged(base: str, adapter: str, directory: str) -> str:
    """`adapter` merged into `base`, saved with the adapter's tokenizer under `directory`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype="float32")
    PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(directory)
    AutoTokenizer.from_pretrained(adapter).save_pretrained(directory)
    return directory


def evaluate_main(args) -> None:
    from trl_opd.models_dir import resolve_model
    from trl_opd.tools.comparison import describe_machine

    rows = [json.loads(line) for line in open(args.heldout)][: args.n]
    if args.system_prompt:  # what a teacher with teacher_system_prompt reads
        rows = [{**row, "prompt": [{"role": "system", "content": args.system_prompt}, *row["prompt"]]} for row in rows]
    base = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = merged(base, args.adapter, scratch) if args.adapter else base
        report = evaluate(model_dir, rows, python=args.python, log=Path(scratch) / "vllm.log",  # its tail on failure
                          max_completion_length=args.max_completion_length, max_tool_calls=args.max_tool_calls,
                          seed=args.seed, workers=args.workers, untagged_tool_calls=args.untagged_tool_calls)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "model": args.model, "adapter": args.adapter, "heldout": args.heldout, "seed": args.seed,
        "max_completion_length": args.max_completion_length, "max_tool_calls": args.max_tool_calls,
        "untagged_tool_calls": args.untagged_tool_calls, "system_prompt": args.system_prompt,
        "machine": describe_machine(), "date": time.strftime("%Y-%m-%d"), **report}, indent=1))


def grpo_main(args) -> None:
    """TRL's GRPOTrainer with the recipe's model, data, environment and optimisation settings; the correctness
    reward instead of the teacher; `num_generations` rollouts per prompt, as many rollouts per step as the recipe."""
    import yaml
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from trl_opd.envs.code_env import CodeToolClient
    from trl_opd.envs.code_output import stated_output_reward
    from trl_opd.models_dir import resolve_model
    from trl_opd.trainer.multiturn import set_tool_call_parser

    recipe = yaml.safe_load(Path(args.config).read_text())
    rollouts = recipe["per_device_train_batch_size"] * recipe.get("num_generations", 1)
    model = resolve_model(recipe["model_name_or_path"])
    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    # the tool-call parsing OPDTrainer sets from the same recipe, so that both read the same calls
    set_tool_call_parser(tokenizer, SimpleNamespace(untagged_tool_calls=recipe.get("untagged_tool_calls", False)),
                         multi_turn=True)
    trainer = GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=stated_output_reward,
        train_dataset=load_dataset("json", data_files=recipe["dataset_name"], split="train"),
        environment_factory=CodeToolClient,
        peft_config=LoraConfig(r=recipe["lora_r"], lora_alpha=recipe["lora_alpha"],
                               target_modules=recipe["lora_target_modules"], task_type="CAUSAL_LM"),
        args=GRPOConfig(
            output_dir=args.output_dir, seed=args.seed, num_generations=args.num_generations,
            per_device_train_batch_size=rollouts, gradient_accumulation_steps=1,
            max_completion_length=recipe["max_completion_length"],
            max_tool_calling_iterations=recipe["max_tool_calling_iterations"], temperature=recipe["temperature"],
            learning_rate=recipe["learning_rate"], max_steps=args.max_steps or recipe["max_steps"], logging_steps=1,
            save_strategy="no", report_to="none", bf16=False, activation_checkpointing=False,
            disable_dropout=True, model_init_kwargs={"dtype": "float32"}),
    )
    trainer.train()
    trainer.save_model(args.output_dir)
    trainer.processing_class.save_pretrained(args.output_dir)


def summary_main(args) -> None:
    """One row per method: each seed's accuracy; the accuracy over all its episodes pooled (the mean over seeds, as
    each evaluates the same programs) with its binomial error and the seeds' sample standard deviation; tool calls
    and the answered share averaged over seeds."""
    import glob
    import statistics

    print("| method | seeds | greedy, each seed | greedy mean | sampled, each seed | sampled mean "
          "| tool calls (g / s) | end with an answer (g / s) |")
    print("|---|---:|---|---:|---|---:|---:|---:|")
    for group in args.group:
        label, pattern = group.split("=", 1)
        runs = [json.loads(Path(f).read_text()) for f in sorted(glob.glob(pattern))]
        if not runs:
            raise SystemExit(f"--group {group!r}: no file matches {pattern!r}")
        cells = []
        for mode in ("greedy", "sampled"):
            accuracy = [run[mode]["accuracy"] for run in runs]
            pooled = binomial(sum(run[mode]["correct"] for run in runs), sum(run[mode]["n"] for run in runs))
            spread = f", sd {statistics.stdev(accuracy):.1%}" if len(runs) > 1 else ""
            cells += [" / ".join(f"{a:.0%}" for a in accuracy),
                      f"{pooled['accuracy']:.1%} ± {pooled['stderr']:.1%}{spread}"]
        mean = {key: {mode: statistics.fmean(run[mode][key] for run in runs) for mode in ("greedy", "sampled")}
                for key in ("tool_calls_per_episode", "episodes_ending_with_an_answer")}
        calls, answered = mean["tool_calls_per_episode"], mean["episodes_ending_with_an_answer"]
        print(f"| {label} | {len(runs)} | {' | '.join(cells)} | {calls['greedy']:.2f} / {calls['sampled']:.2f} "
              f"| {answered['greedy']:.0%} / {answered['sampled']:.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    ev = commands.add_parser("evaluate", help="held-out accuracy of a model (and adapter) through the server")
    ev.add_argument("model", help="a model directory or Hub id (read from OPD_MODELS_DIR where set)")
    ev.add_argument("--adapter", help="a LoRA adapter directory, merged into the model first")
    ev.add_argument("--json", required=True)
    ev.add_argument("--heldout", default="artifacts/code_agent_task/heldout.jsonl")
    ev.add_argument("--n", type=int, default=100)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--max-completion-length", type=int, default=160)
    ev.add_argument("--max-tool-calls", type=int, default=2)
    ev.add_argument("--system-prompt", help="a system message before each prompt (a teacher's teacher_system_prompt)")
    ev.add_argument("--untagged-tool-calls", action=argparse.BooleanOptionalAction, default=True,
                    help="also run a turn that is only a JSON call (the recipe's untagged_tool_calls)")
    ev.add_argument("--workers", type=int, default=16, help="episodes in flight")
    ev.add_argument("--python", default=str(ROOT / ".venv-vllm" / "bin" / "python"), help="vLLM's interpreter")
    grpo = commands.add_parser("grpo", help="train with TRL's GRPOTrainer and the correctness reward")
    grpo.add_argument("--config", default="recipes/agent_code_env_cpu.yaml")
    grpo.add_argument("--seed", type=int, default=42)
    grpo.add_argument("--num-generations", type=int, default=4)
    grpo.add_argument("--output_dir", required=True)
    grpo.add_argument("--max-steps", type=int, help="the recipe's max_steps unless given")
    summary = commands.add_parser("summary", help="a markdown table of evaluations, one row per method")
    summary.add_argument("--group", action="append", required=True,
                         help="LABEL=GLOB: the evaluations (--json files) of one method, one per seed")
    args = parser.parse_args()
    {"evaluate": evaluate_main, "grpo": grpo_main, "summary": summary_main}[args.command](args)


if __name__ == "__main__":
    main()
