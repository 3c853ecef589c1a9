"""Does OPD bring the student closer to the teacher on prompts it never trained on?

Trains the tiny local student against the tiny local teacher (`trl-opd make-tiny`) for a few dozen steps, and
measures KL(student || teacher) on fixed held-out prompts before training and every `--eval-every` steps, with the
evaluation code in `trl_opd.evaluation` (not the trainer's logged numbers). Prints the markdown table of
docs/benchmarks.md.

    .venv/bin/python benchmarks/heldout_reverse_kl.py --steps 60 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run(tiny: Path, *, seed: int, steps: int, eval_every: int, lora: bool, heldout: list, estimator: str) -> dict:
    from datasets import load_dataset
    from peft import LoraConfig

    from trl_opd import OPDConfig, OPDTrainer
    from trl_opd.evaluation import HeldoutReverseKLCallback

    with tempfile.TemporaryDirectory() as output_dir:
        args = OPDConfig(
            output_dir=output_dir, per_device_train_batch_size=16, num_generations=1, max_completion_length=24,
            learning_rate=3e-3 if lora else 1e-3, max_steps=steps, logging_steps=eval_every, save_strategy="no",
            report_to="none", bf16=False, activation_checkpointing=False, seed=seed, opd_estimator=estimator,
        )
        trainer = OPDTrainer(
            model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=args,
            train_dataset=load_dataset("json", data_files=str(tiny / "train.jsonl"), split="train"),
            peft_config=LoraConfig(r=32, lora_alpha=64, target_modules="all-linear") if lora else None,
        )
        callback = HeldoutReverseKLCallback(
            trainer.teacher_model, trainer.processing_class, heldout, eval_every=eval_every, max_new_tokens=24,
            samples_per_prompt=2, seed=1234,
        )
        trainer.add_callback(callback)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    return {"history": callback.history, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", default="artifacts/tiny")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--estimator", default="sampled", choices=["sampled", "topk", "full"])
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()

    from trl_opd.tiny import make_tiny

    tiny = make_tiny(args.tiny)
    heldout = [json.loads(line)["prompt"] for line in open(tiny / "heldout.jsonl")][:32]
    results = {}
    for name, lora in (("full", False), ("lora", True)):
        results[name] = [
            run(tiny, seed=seed, steps=args.steps, eval_every=args.eval_every, lora=lora, heldout=heldout,
                estimator=args.estimator)
            for seed in args.seeds
        ]

    from trl_opd.tools.comparison import describe_machine

    print(f"\nHeld-out KL(student || teacher), 32 prompts x 2 samples, mean (range) over seeds {args.seeds}; "
          f"{describe_machine()}, {time.strftime('%Y-%m-%d')}\n")
    print("| student | step | reverse KL (sampled) | reverse KL (exact) | change vs step 0 (exact) |")
    print("|---|---:|---:|---:|---:|")
    for name, runs in results.items():
        steps = [step for step, _ in runs[0]["history"]]
        first = statistics.mean(r["history"][0][1]["reverse_kl_exact"] for r in runs)
        for i, step in enumerate(steps):
            sampled = statistics.mean(r["history"][i][1]["reverse_kl"] for r in runs)
            values = [r["history"][i][1]["reverse_kl_exact"] for r in runs]
            exact = statistics.mean(values)
            # per seed, the change against its own step 0: its range over seeds
            changes = [100 * (r["history"][i][1]["reverse_kl_exact"] / r["history"][0][1]["reverse_kl_exact"] - 1)
                       for r in runs]
            print(f"| {name} | {step} | {sampled:.3f} | {exact:.3f} ({min(values):.3f}-{max(values):.3f}) | "
                  f"{100 * (exact / first - 1):+.0f}% ({min(changes):+.0f}% to {max(changes):+.0f}%) |")
        seconds = statistics.mean(r["seconds"] for r in runs)
        print(f"| {name} | train wall time | {seconds:.1f} s (incl. evaluations) | | |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
