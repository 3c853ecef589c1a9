"""What the exact term from a served teacher costs and buys, on the real pair, in one run: Qwen2.5-Coder-0.5B-Instruct
(LoRA) from the 1.5B on the code task, trained the same steps three ways:

  local-full   the teacher loaded in the training process, opd_estimator 'full'
  served-full  the teacher behind `trl-opd serve-teacher --hidden-states`, its head held here, 'full'
  served-topk  the teacher behind `trl-opd serve-teacher` (log-probs), 'topk' (k = 20)

Each variant trains in its own process (its peak memory is its own; no other server runs beside it, vLLM's CPU
engine busy-polls a core). Reported: seconds per step; the teacher's scoring throughput (completion tokens scored per
second of its `score` calls); bytes per scored token on the wire, measured (the responses' bodies), beside what
float32 logits would be; the training process's peak resident memory before the evaluation; held-out accuracy
(greedy and sampled, binomial errors) and the exact KL(student || teacher) on the student's samples after training.

    OPD_MODELS_DIR=~/.cache/real-models .venv/bin/python benchmarks/served_full_cost.py --steps 32 \
        --json benchmarks/results/served_full_cost.json               # about 60 minutes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).parents[1]
VARIANTS = ("local-full", "served-full", "served-topk")


def train(args) -> dict:
    """One variant, in this process: train, measure, evaluate."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_opd import OPDConfig, OPDTrainer
    from trl_opd.envs.code_output import printed_output_reward
    from trl_opd.evaluation import heldout_reverse_kl
    from trl_opd.models_dir import resolve_model

    student, teacher = resolve_model(args.student), resolve_model(args.teacher)
    source = {"local-full": dict(teacher_model_name_or_path=teacher, opd_estimator="full"),
              "served-full": dict(teacher_server_url=args.url, teacher_model_name_or_path=teacher,
                                  opd_estimator="full"),
              "served-topk": dict(teacher_server_url=args.url, opd_estimator="topk")}[args.variant]
    prompts = load_dataset("json", data_files=str(Path(args.task) / "train.jsonl"), split="train")
    heldout = [json.loads(line) for line in open(Path(args.task) / "heldout.jsonl")][: args.eval_prompts]
    with tempfile.TemporaryDirectory() as scratch:
        config = OPDConfig(output_dir=scratch, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
                           num_generations=1, max_completion_length=16, temperature=1.0, learning_rate=2e-4,
                           seed=args.seed, save_strategy="no", report_to="none", bf16=False,
                           activation_checkpointing=False, disable_dropout=True, logging_steps=1, disable_tqdm=True,
                           **source)
        trainer = OPDTrainer(model=student, train_dataset=prompts, args=config,
                             peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                    task_type="CAUSAL_LM"))
        scoring = {"seconds": 0.0, "tokens": 0, "bytes": 0}
        score = trainer.teacher.score

        def timed_score(*batch):
            start = time.perf_counter()
            scores = score(*batch)
            scoring["seconds"] += time.perf_counter() - start
            scoring["tokens"] += int(batch[3].sum())
            return scores

        trainer.teacher.score = timed_score
        if hasattr(trainer.teacher, "_session"):  # every response body the teacher's client reads
            request = trainer.teacher._session.request

            def counted(*a, **k):
                response = request(*a, **k)
                scoring["bytes"] += len(response.content)
                return response

            trainer.teacher._session.request = counted
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        logs = [entry for entry in trainer.state.log_history if "opd/reverse_kl" in entry]
        reference = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
        metrics = heldout_reverse_kl(trainer.model, reference, AutoTokenizer.from_pretrained(student),
                                     [row["prompt"] for row in heldout], max_new_tokens=16, seed=1234,
                                     solutions=[row["solution"] for row in heldout],
                                     accuracy_func=printed_output_reward, greedy_accuracy=True)
    vocab, hidden = reference.config.vocab_size, reference.config.hidden_size
    return {"variant": args.variant, "steps": args.steps, "seconds_per_step": seconds / args.steps,
            "scoring_tokens_per_second": scoring["tokens"] / max(scoring["seconds"], 1e-9),
            "scored_tokens": scoring["tokens"],
            "wire_bytes_per_token": scoring["bytes"] / scoring["tokens"] if scoring["bytes"] else None,
            "float32_logits_bytes_per_token": vocab * 4, "hidden_size": hidden,
            "peak_rss_mib_training": peak, "heldout": metrics,
            "final_train_reverse_kl": logs[-1]["opd/reverse_kl"] if logs else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student", default="Qwen/Qwen2.5-Coder-0.5B-Instruct")
    parser.add_argument("--teacher", default="Qwen/Qwen2.5-Coder-1.5B-Instruct")
    parser.add_argument("--task", default="artifacts/code_task")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--eval-prompts", type=int, default=100)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--python", default=str(ROOT / ".venv-vllm" / "bin" / "python"), help="vLLM's interpreter")
    parser.add_argument("--json")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # a worker: one variant
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print("RESULT " + json.dumps(train(args)), flush=True)
        return

    from trl_opd.models_dir import resolve_model
    from trl_opd.tools.comparison import describe_machine
    from trl_opd.tools.testing import TeacherServerProcess

    results = []
    for variant in args.variants:
        worker = [sys.executable, __file__, "--variant", variant, "--steps", str(args.steps), "--seed", str(args.seed),
                  "--batch-size", str(args.batch_size), "--eval-prompts", str(args.eval_prompts), "--task", args.task,
                  "--student", args.student, "--teacher", args.teacher]
        with tempfile.TemporaryDirectory() as scratch:
            served = variant.startswith("served")
            server = TeacherServerProcess(resolve_model(args.teacher), Path(scratch) / "vllm.log", args.python,
                                          max_model_len=1024,
                                          extra=("--hidden-states",) if variant == "served-full" else ())
            with server if served else contextlib.nullcontext():
                out = subprocess.run(worker + (["--url", server.url] if served else []), capture_output=True,
                                     text=True, check=False)
        line = next((line for line in out.stdout.splitlines() if line.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"{variant} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        results.append(json.loads(line.removeprefix("RESULT ")))
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": describe_machine(), "date": time.strftime("%Y-%m-%d"),
                                               "results": results}, indent=1))


if __name__ == "__main__":
    main()
