"""OPD estimators against TRL's DistillationTrainer: held-out KL reduction, seconds per step, peak memory.

Same tiny pair, prompts, steps, batch and learning rate for every method; full fine-tuning. Methods: OPD with the
sampled-token estimator; with the top-k (k = 1, 5, 20) or full-vocabulary dense term alone (`opd_coef` 0); with the
top-20 or full term added to the sampled one ("+sampled"); the top-20 and full terms as the forward KL and the full
term as the JSD (`opd_divergence_beta` 0 and 0.5); and TRL's DistillationTrainer with beta 1 (reverse KL).
Runs are interleaved (every method once per seed, in turn) so that slow phases of a shared machine hit each method
alike. Held-out KL is measured by `trl_opd.evaluation` (the exact full-vocabulary KL(student || teacher), and the
forward KL(teacher || student), at student-sampled states on 32 held-out prompts x 2 samples), not by any trainer's
logged number. Each run is its own process, so peak RSS is per run. Two gaps: the `make-tiny` student ("wide") and
the same student trained 4x longer ("narrow").

    .venv/bin/python benchmarks/estimators.py --steps 60 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# method -> OPDConfig overrides (None: TRL's DistillationTrainer)
METHODS = {
    "opd-sampled": {"opd_estimator": "sampled"},
    "opd-topk1": {"opd_estimator": "topk", "opd_topk": 1, "opd_coef": 0.0},
    "opd-topk5": {"opd_estimator": "topk", "opd_topk": 5, "opd_coef": 0.0},
    "opd-topk20": {"opd_estimator": "topk", "opd_topk": 20, "opd_coef": 0.0},
    "opd-full": {"opd_estimator": "full", "opd_coef": 0.0},
    "opd-topk20+sampled": {"opd_estimator": "topk", "opd_topk": 20, "opd_coef": 1.0},
    "opd-full+sampled": {"opd_estimator": "full", "opd_coef": 1.0},
    # other divergences (TRL's beta: 0 forward KL, 0.5 the generalised JSD halfway)
    "opd-topk20-forward-kl": {"opd_estimator": "topk", "opd_topk": 20, "opd_coef": 0.0, "opd_divergence_beta": 0.0},
    "opd-full-forward-kl": {"opd_estimator": "full", "opd_coef": 0.0, "opd_divergence_beta": 0.0},
    "opd-full-jsd": {"opd_estimator": "full", "opd_coef": 0.0, "opd_divergence_beta": 0.5},
    "trl-distillation": None,
}


def narrow_student(tiny: Path, destination: Path) -> Path:
    """The tiny student trained on answers 4x longer: a smaller gap to the teacher."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_opd.tiny import train_on_answers

    if not (destination / "config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(tiny / "student")
        model = AutoModelForCausalLM.from_pretrained(tiny / "student")
        train_on_answers(model, tokenizer, steps=90, seed=3)
        model.save_pretrained(destination)
        tokenizer.save_pretrained(destination)
    return destination


WARMUP_STEPS = 5  # not timed: the first steps carry one-off costs (allocation, first generate) of ~0.5 s


def _step_clock():
    """A callback that records the wall-clock time at the end of every optimizer step."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

    return StepClock()


def one_run(method: str, student: str, tiny: Path, seed: int, steps: int) -> dict:
    from datasets import load_dataset

    from trl_opd.evaluation import heldout_reverse_kl

    prompts = load_dataset("json", data_files=str(tiny / "train.jsonl"), split="train")
    heldout = [json.loads(line)["prompt"] for line in open(tiny / "heldout.jsonl")][:32]
    common = dict(per_device_train_batch_size=16, max_completion_length=24, learning_rate=1e-3, max_steps=steps,
                  logging_steps=steps, save_strategy="no", report_to="none", bf16=False, activation_checkpointing=False,
                  seed=seed)
    with tempfile.TemporaryDirectory() as output_dir:
        if METHODS[method] is None:
            from trl import DistillationConfig, DistillationTrainer

            trainer = DistillationTrainer(model=student, teacher_model=str(tiny / "teacher"), train_dataset=prompts,
                                          args=DistillationConfig(output_dir=output_dir, beta=1.0, **common))
            teacher = trainer.teacher_model
        else:
            from trl_opd import OPDConfig, OPDTrainer

            trainer = OPDTrainer(model=student, teacher_model=str(tiny / "teacher"), train_dataset=prompts,
                                 args=OPDConfig(output_dir=output_dir, num_generations=1, **METHODS[method], **common))
            teacher = trainer.teacher_model
        evaluate = lambda: heldout_reverse_kl(  # noqa: E731
            trainer.model, teacher, trainer.processing_class, heldout, max_new_tokens=24, samples_per_prompt=2,
            seed=1234,
        )
        before = evaluate()
        clock = _step_clock()
        trainer.add_callback(clock)
        start = time.perf_counter()
        trainer.train()
        after = evaluate()
    times = clock.times
    return {"method": method, "seed": seed, "kl_before": before["reverse_kl_exact"],
            "kl_after": after["reverse_kl_exact"], "forward_kl_before": before["forward_kl_exact"],
            "forward_kl_after": after["forward_kl_exact"],
            "seconds_per_step": (times[-1] - times[WARMUP_STEPS - 1]) / (len(times) - WARMUP_STEPS),
            "warmup_seconds": times[WARMUP_STEPS - 1] - start,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", default="artifacts/tiny")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--one", nargs=3, metavar=("METHOD", "STUDENT", "SEED"), help=argparse.SUPPRESS)
    parser.add_argument("--json")
    args = parser.parse_args()

    from trl_opd.tiny import make_tiny

    tiny = make_tiny(args.tiny)
    if args.one:
        method, student, seed = args.one
        print("RESULT " + json.dumps(one_run(method, student, tiny, int(seed), args.steps)))
        return

    students = {"wide": str(tiny / "student"), "narrow": str(narrow_student(tiny, tiny / "student-narrow"))}
    results = []
    for gap, student in students.items():
        for seed in args.seeds:
            for method in args.methods:
                command = [sys.executable, __file__, "--tiny", str(tiny), "--steps", str(args.steps),
                           "--one", method, student, str(seed)]
                out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
                result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
                results.append({"gap": gap, **result})
                print(json.dumps(results[-1]), file=sys.stderr)

    from trl_opd.tools.comparison import describe_machine

    print(f"\n{args.steps} steps, batch 16, lr 1e-3, full fine-tune; mean (reduction: range) over seeds {args.seeds}; "
          f"s/step after {WARMUP_STEPS} warm-up steps; {describe_machine()}, {time.strftime('%Y-%m-%d')}\n")
    print("| gap | method | held-out KL before -> after | reduction | held-out forward KL before -> after | "
          f"reduction | s/step | s/step vs TRL | first {WARMUP_STEPS} steps | peak RSS |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for gap in students:
        def mean(method, key, gap=gap):
            return statistics.mean(r[key] for r in results if r["gap"] == gap and r["method"] == method)

        def reduction(method, key, gap=gap):
            runs = [r for r in results if r["gap"] == gap and r["method"] == method]
            # per run, 1 - after / before; its mean and range over seeds
            average, low, high = (100 * (1 - f(r[f"{key}_after"] / r[f"{key}_before"] for r in runs))
                                  for f in (statistics.mean, max, min))
            before, after = (statistics.mean(r[f"{key}_{when}"] for r in runs) for when in ("before", "after"))
            return f"{before:.3f} -> {after:.3f} | {average:.0f}% ({low:.0f}% to {high:.0f}%)"

        for method in args.methods:
            speed = mean(method, "seconds_per_step") / mean("trl-distillation", "seconds_per_step")
            print(f"| {gap} | {method} | {reduction(method, 'kl')} | {reduction(method, 'forward_kl')} | "
                  f"{mean(method, 'seconds_per_step'):.3f} | {speed:.2f}x | {mean(method, 'warmup_seconds'):.2f} s | "
                  f"{mean(method, 'peak_rss_mib'):.0f} MiB |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
