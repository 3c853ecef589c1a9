"""Where an OPD step's time goes: generation, teacher scoring, the student's update, and everything else.

    .venv/bin/python benchmarks/step_breakdown.py --recipe recipes/real_cpu.yaml --steps 6
    .venv/bin/python benchmarks/step_breakdown.py --recipe recipes/smoke_cpu.yaml --model_name_or_path ...

Trains the recipe (extra arguments override it, as on the command line) for `--steps` steps with timers around the
trainer's own stages, and prints seconds per step and share for each:
- generation: the student sampling its completions (GRPO's `_generate`);
- teacher scoring: the teacher's pass over prompt + completion (`teacher.score`);
- student update: the loss forward and backward (`training_step` less its input preparation) and the optimizer step;
- everything else: the step time less those three (old log-probs when kept, batching, metrics, callbacks).
The first step is left out (warm-up). The ratio of the step time to the sum of the three essential parts is the
trainer's own overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")

STAGES = ("generation", "teacher scoring", "student update")


class StageTimer:
    """Seconds per stage and per step, accumulated by wrapping bound methods."""

    def __init__(self):
        self.current, self.steps, self.step_start = defaultdict(float), [], None

    def wrap(self, owner, name: str, stage: str, *, subtract: str | None = None) -> None:
        """Time `owner.name` into `stage`; with `subtract`, less the time that stage gained during the call."""
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            start, before = time.perf_counter(), self.current[subtract] if subtract else 0.0
            try:
                return method(*args, **kwargs)
            finally:
                inner = (self.current[subtract] - before) if subtract else 0.0
                self.current[stage] += time.perf_counter() - start - inner

        setattr(owner, name, timed)


def main(argv: list[str] | None = None) -> None:
    from transformers import TrainerCallback

    from trl_opd import cli

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", help="write the breakdown here")
    args, overrides = parser.parse_known_args(argv)
    script_args, training_args, model_args = cli.make_parser().parse_args_and_config([
        "--config", args.recipe, "--max_steps", str(args.steps), "--eval_strategy", "no", "--eval_on_start", "false",
        "--save_strategy", "no",
        "--report_to", "none", "--logging_steps", "1", "--output_dir", "/tmp/step_breakdown", *overrides,
    ])
    trainer = cli.build_trainer(script_args, training_args, model_args)
    timer = StageTimer()
    # the outermost stage first: input preparation (generation and scoring inside it) is not the update
    timer.wrap(trainer, "_prepare_inputs", "preparation")
    timer.wrap(trainer, "training_step", "student update", subtract="preparation")
    timer.wrap(trainer, "_generate", "generation")
    timer.wrap(trainer.teacher, "score", "teacher scoring")
    optimizer_start = []

    class Steps(TrainerCallback):
        def on_step_begin(self, *a, **k):
            timer.current.clear()
            timer.step_start = time.perf_counter()

        def on_pre_optimizer_step(self, *a, **k):
            optimizer_start.append(time.perf_counter())

        def on_optimizer_step(self, *a, **k):
            timer.current["student update"] += time.perf_counter() - optimizer_start.pop()

        def on_step_end(self, *a, **k):
            timer.steps.append({"step": time.perf_counter() - timer.step_start, **timer.current})

    trainer.add_callback(Steps())
    trainer.train()

    measured = timer.steps[1:] or timer.steps
    mean = {key: sum(step.get(key, 0.0) for step in measured) / len(measured)
            for key in ("step", *STAGES)}
    essential = sum(mean[stage] for stage in STAGES)
    rows = {stage: mean[stage] for stage in STAGES}
    rows["everything else"] = mean["step"] - essential
    result = {"recipe": args.recipe, "overrides": overrides, "steps_measured": len(measured),
              "seconds_per_step": mean["step"], "stages": rows, "overhead_ratio": mean["step"] / essential}
    print(f"{len(measured)} steps after the first, {mean['step']:.2f} s per step:")
    for stage, seconds in rows.items():
        print(f"  {stage:<16} {seconds:7.2f} s  {seconds / mean['step']:6.1%}")
    print(f"  step / (generation + scoring + update) = {result['overhead_ratio']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
