"""What overlapping a slow served teacher's scoring with the student's update saves (`opd_overlap_scoring`).

The tiny student distils from the tiny teacher served by vLLM's CPU server behind a loopback proxy that holds every
request for `--delay` seconds (a far or busy teacher, without one). Each seed trains `--steps` steps synchronously and
with overlap, on the same data, and reports seconds per step (training only) and the held-out reverse KL before and
after (`trl_opd.evaluation`, the same prompts and samples for both). Also measured, in the synchronous runs: the time a
step spends outside generation and scoring (the update), which overlap can hide the delay behind.

    .venv/bin/python benchmarks/overlap_scoring.py --delay 0.3 --seeds 0 1 2 [--json PATH]
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


def run(tiny: Path, url: str, teacher, heldout: list, *, seed: int, steps: int, overlap: bool) -> dict:
    from datasets import load_dataset

    from trl_opd import OPDConfig, OPDTrainer
    from trl_opd.evaluation import HeldoutReverseKLCallback

    with tempfile.TemporaryDirectory() as output_dir:
        args = OPDConfig(
            output_dir=output_dir, per_device_train_batch_size=16, num_generations=1, max_completion_length=24,
            learning_rate=1e-3, max_steps=steps, logging_steps=steps, save_strategy="no", report_to="none",
            bf16=False, gradient_checkpointing=False, seed=seed, opd_estimator="sampled", teacher_server_url=url,
            opd_overlap_scoring=overlap,
        )
        trainer = OPDTrainer(model=str(tiny / "student"), args=args,
                             train_dataset=load_dataset("json", data_files=str(tiny / "train.jsonl"), split="train"))
        # evaluated before the first step and after the last only: nothing is being scored in the background then
        callback = HeldoutReverseKLCallback(teacher, trainer.processing_class, heldout, eval_every=steps,
                                            max_new_tokens=24, samples_per_prompt=2, seed=1234)
        trainer.add_callback(callback)
        generation = _time_generation(trainer)
        trainer.train()
    (_, before), (_, after) = callback.history[0], callback.history[-1]
    seconds = after["train_seconds"]
    return {"seed": seed, "overlap": overlap, "seconds_per_step": seconds / steps,
            "update_seconds_per_step": (seconds - sum(generation)) / steps,
            "staleness": [entry["opd/staleness"] for entry in trainer.state.log_history if "opd/staleness" in entry],
            "kl_before": before["reverse_kl_exact"], "kl_after": after["reverse_kl_exact"]}


def _time_generation(trainer) -> list[float]:
    """Seconds in each call of the trainer's generation-and-scoring (the rest of a step is its update)."""
    seconds, generate = [], trainer._generate_and_score_completions

    def timed(inputs):
        start = time.perf_counter()
        try:
            return generate(inputs)
        finally:
            seconds.append(time.perf_counter() - start)

    trainer._generate_and_score_completions = timed
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", default="artifacts/tiny")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--delay", type=float, default=0.3, help="seconds the proxy holds each teacher request")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from trl_opd.comparison import describe_machine
    from trl_opd.testing import DelayedTeacherProxy, TeacherServerProcess, make_tiny

    tiny = make_tiny(args.tiny)
    teacher = AutoModelForCausalLM.from_pretrained(tiny / "teacher").eval()
    heldout = [json.loads(line)["prompt"] for line in open(tiny / "heldout.jsonl")][:32]
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        python = os.path.abspath(args.vllm_python)
        with TeacherServerProcess(tiny / "teacher", f"{scratch}/server.log", python) as server, \
                DelayedTeacherProxy(server.url, args.delay) as proxy:
            for seed in args.seeds:
                for overlap in (False, True):
                    runs.append(run(tiny, proxy.url, teacher, heldout, seed=seed, steps=args.steps, overlap=overlap))
                    print(runs[-1], flush=True)

    machine, date = describe_machine(), time.strftime("%Y-%m-%d")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "date": date, "delay": args.delay, "steps": args.steps,
                                         "runs": runs}, indent=1) + "\n")
    print(f"\nTiny pair, served teacher behind a {args.delay:g} s delay per request, {args.steps} steps, seeds "
          f"{args.seeds}; {machine}, {date}. Mean (range) over seeds.\n")
    print("| scoring | s/step | steps/s vs synchronous | update s/step | held-out KL before -> after |")
    print("|---|---:|---:|---:|---:|")
    sync_speed = statistics.mean(1 / run["seconds_per_step"] for run in runs if not run["overlap"])
    for overlap in (False, True):
        group = [run for run in runs if run["overlap"] == overlap]
        step = [run["seconds_per_step"] for run in group]
        speed = statistics.mean(1 / s for s in step) / sync_speed
        after = [run["kl_after"] for run in group]
        update = statistics.mean(run["update_seconds_per_step"] for run in group)
        print(f"| {'overlapped' if overlap else 'synchronous'} | {statistics.mean(step):.3f} ({min(step):.3f}-"
              f"{max(step):.3f}) | {speed:.2f}x | {update:.3f} "
              f"| {statistics.mean(run['kl_before'] for run in group):.4f} -> {statistics.mean(after):.4f} "
              f"({min(after):.4f}-{max(after):.4f}) |")


if __name__ == "__main__":
    main()
