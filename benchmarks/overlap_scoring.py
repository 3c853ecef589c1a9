"""What overlapping a slow served teacher's scoring with the student's update saves (`opd_overlap_scoring`).

The tiny student distils from the tiny teacher served by vLLM's CPU server behind a loopback proxy that holds every
request for `--delay` seconds (a far or busy teacher, without one). Each seed trains `--steps` steps synchronously and
with overlap, on the same data, and reports seconds per step (training only) and the held-out reverse KL before and
after (`trl_opd.evaluation`, the same prompts and samples for both). Also measured, in the synchronous runs: the time a
step spends outside generation and scoring (the update), which overlap can hide the delay behind.

By default server and trainer share the machine's cores: vLLM's CPU engine then keeps a core busy and slows every
step's update (the tiny student's update of 16 completions takes 0.66 s so, 0.03 s on a core of its own).
`--separate-cores` gives each a core of its own, as a teacher on other devices would have: the server on the last
core, the trainer (one torch thread) on the others. Also printed: the synchronous step's parts (generation and the
rest, teacher, update) and the most overlap could save with them, min(teacher, update).

    .venv/bin/python benchmarks/overlap_scoring.py --delay 0.2 --seeds 0 1 2 --steps 30 --batch-size 256 \
        --separate-cores [--json PATH]
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


def run(tiny: Path, url: str, teacher, heldout: list, *, seed: int, steps: int, overlap: bool, batch_size: int,
        accumulation: int) -> dict:
    from datasets import concatenate_datasets, load_dataset

    from trl_opd import OPDConfig, OPDTrainer
    from trl_opd.evaluation import HeldoutReverseKLCallback

    with tempfile.TemporaryDirectory() as output_dir:
        args = OPDConfig(
            output_dir=output_dir, per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation,
            num_generations=1, max_completion_length=24,
            learning_rate=1e-3, max_steps=steps, logging_steps=steps, save_strategy="no", report_to="none",
            bf16=False, activation_checkpointing=False, seed=seed, opd_estimator="sampled", teacher_server_url=url,
            opd_overlap_scoring=overlap,
        )
        # the prompts repeated so that one epoch spans the run: each epoch's first batch cannot be scored ahead (the
        # loader is not read across an epoch's end), which with 512 prompts and large batches would be every few steps
        prompts = load_dataset("json", data_files=str(tiny / "train.jsonl"), split="train")
        repeats = -(-steps * batch_size * accumulation // len(prompts)) + 1
        trainer = OPDTrainer(model=str(tiny / "student"), args=args,
                             train_dataset=concatenate_datasets([prompts] * repeats))
        # evaluated before the first step and after the last only: nothing is being scored in the background then
        callback = HeldoutReverseKLCallback(teacher, trainer.processing_class, heldout, eval_every=steps,
                                            max_new_tokens=24, samples_per_prompt=2, seed=1234)
        trainer.add_callback(callback)
        generation = _time_generation(trainer)
        scoring = _time_scoring(trainer)
        trainer.train()
    (_, before), (_, after) = callback.history[0], callback.history[-1]
    seconds = after["train_seconds"]
    return {"seed": seed, "overlap": overlap, "seconds_per_step": seconds / steps,
            "update_seconds_per_step": (seconds - sum(generation)) / steps,
            "scoring_seconds_per_step": sum(scoring) / len(scoring),
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


def _time_scoring(trainer) -> list[float]:
    """Seconds in each call of the teacher's scoring (in the background thread, with overlap)."""
    seconds, score = [], trainer.teacher.score

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return score(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    trainer.teacher.score = timed
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", default="artifacts/tiny")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--delay", type=float, default=0.3, help="seconds the proxy holds each teacher request")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--batch-size", type=int, default=16, help="completions per micro-batch")
    parser.add_argument("--accumulation", type=int, default=1,
                        help="micro-batches per optimizer step (one generation batch of batch-size x accumulation)")
    parser.add_argument("--separate-cores", action="store_true",
                        help="the server on the last core, the trainer (one torch thread) on the others")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if args.separate_cores:
        if len(cores) < 2:
            raise SystemExit("--separate-cores needs at least 2 cores.")
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[-1])  # the server's engine, inherited below
        os.sched_setaffinity(0, cores[-1:])  # the server process started below inherits this core

    from transformers import AutoModelForCausalLM

    from trl_opd.tiny import make_tiny
    from trl_opd.tools.comparison import describe_machine
    from trl_opd.tools.testing import DelayedTeacherProxy, TeacherServerProcess

    tiny = make_tiny(args.tiny)
    teacher = AutoModelForCausalLM.from_pretrained(tiny / "teacher").eval()
    heldout = [json.loads(line)["prompt"] for line in open(tiny / "heldout.jsonl")][:32]
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        python = os.path.abspath(args.vllm_python)
        with TeacherServerProcess(tiny / "teacher", f"{scratch}/server.log", python) as server, \
                DelayedTeacherProxy(server.url, args.delay) as proxy:
            if args.separate_cores:
                import torch

                os.sched_setaffinity(0, cores[:-1])
                torch.set_num_threads(len(cores) - 1)
            for seed in args.seeds:
                for overlap in (False, True):
                    runs.append(run(tiny, proxy.url, teacher, heldout, seed=seed, steps=args.steps, overlap=overlap,
                                    batch_size=args.batch_size, accumulation=args.accumulation))
                    print(runs[-1], flush=True)

    machine, date = describe_machine(), time.strftime("%Y-%m-%d")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "date": date, "delay": args.delay, "steps": args.steps,
                                         "batch_size": args.batch_size, "accumulation": args.accumulation,
                                         "separate_cores": args.separate_cores, "runs": runs}, indent=1) + "\n")
    where = "server and trainer on separate cores" if args.separate_cores else "server and trainer share the cores"
    print(f"\nTiny pair, served teacher behind a {args.delay:g} s delay per request, {args.steps} steps of "
          f"{args.accumulation} x {args.batch_size} completions, seeds {args.seeds}, {where}; {machine}, {date}. "
          "Mean (range) over seeds.\n")
    print("| scoring | s/step | steps/s vs synchronous | update s/step | teacher s/batch "
          "| held-out KL before -> after |")
    print("|---|---:|---:|---:|---:|---:|")
    sync_speed = statistics.mean(1 / run["seconds_per_step"] for run in runs if not run["overlap"])
    for overlap in (False, True):
        group = [run for run in runs if run["overlap"] == overlap]
        step = [run["seconds_per_step"] for run in group]
        speed = statistics.mean(1 / s for s in step) / sync_speed
        after = [run["kl_after"] for run in group]
        update = statistics.mean(run["update_seconds_per_step"] for run in group)
        scoring = statistics.mean(run["scoring_seconds_per_step"] for run in group)
        print(f"| {'overlapped' if overlap else 'synchronous'} | {statistics.mean(step):.3f} ({min(step):.3f}-"
              f"{max(step):.3f}) | {speed:.2f}x | {update:.3f} | {scoring:.3f} "
              f"| {statistics.mean(run['kl_before'] for run in group):.4f} -> {statistics.mean(after):.4f} "
              f"({min(after):.4f}-{max(after):.4f}) |")


    sync = [run for run in runs if not run["overlap"]]
    step, update, scoring = (statistics.mean(run[name] for run in sync) for name in (
        "seconds_per_step", "update_seconds_per_step", "scoring_seconds_per_step"))
    rest = step - update - scoring  # generation, old log-probs, everything but the update and the teacher
    print(f"\nSynchronous step: {rest:.3f} s generation and the rest, {scoring:.3f} s teacher, {update:.3f} s update. "
          f"Overlap hides at most min(teacher, update) of it: at best {step / (step - min(scoring, update)):.2f}x.")


if __name__ == "__main__":
    main()
