"""Where an OPD step's time goes: generation, teacher scoring, the student's update, and everything else.

    .venv/bin/python benchmarks/step_breakdown.py --recipe recipes/real_cpu.yaml --steps 6
    .venv/bin/python benchmarks/step_breakdown.py --recipe recipes/real_cpu.yaml --steps 6 --trainer trl-distillation
    .venv/bin/python benchmarks/step_breakdown.py --recipe recipes/smoke_cpu.yaml --model_name_or_path ...

Trains the recipe (extra arguments override it, as on the command line) for `--steps` steps with timers around the
trainer's own stages, and prints seconds per step and share for each:
- generation: the student sampling its completions (GRPO's `_generate`);
- teacher scoring: the teacher's pass over prompt + completion (`teacher.score`);
- student update: the loss forward and backward (`training_step` less its input preparation) and the optimizer step;
- everything else: the step time less those three (old log-probs when kept, batching, metrics, callbacks).
The first generation batch's steps are left out (warm-up: the first step, or the first steps_per_generation /
gradient_accumulation_steps steps when a generation batch serves several). The ratio of the step time to the sum of
the three essential parts is the trainer's own overhead. It also reports the throughput, tokens (prompt and
completion, GRPO's `num_tokens`) per second per process over the measured steps, and `completions/mean_length`
against `max_completion_length` (the tail that asynchronous generation would win back; meaningful only with trained
weights: a randomly initialised model rarely ends a completion before the limit).

`--trainer trl-distillation` times TRL's DistillationTrainer (reverse KL, beta 1) on the recipe's student, teacher,
prompts, LoRA, learning rate, batch, completion length and seed, stage by stage the same way: there the teacher's
forward runs inside the loss, and is taken out of the update.
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

    def wrap(self, owner, name: str, stage: str, *, subtract: tuple[str, ...] = (), when=None) -> None:
        """Time `owner.name` into `stage`, less the time the `subtract` stages gained during the call; with `when`,
        only the calls whose arguments it accepts."""
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            if when is not None and not when(*args, **kwargs):
                return method(*args, **kwargs)
            start, before = time.perf_counter(), sum(self.current[other] for other in subtract)
            try:
                return method(*args, **kwargs)
            finally:
                inner = sum(self.current[other] for other in subtract) - before
                self.current[stage] += time.perf_counter() - start - inner

        setattr(owner, name, timed)


def main(argv: list[str] | None = None) -> None:
    from transformers import TrainerCallback

    from trl_opd.tools import recipe

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--trainer", choices=("opd", "trl-distillation"), default="opd")
    parser.add_argument("--json", help="write the breakdown here")
    args, overrides = parser.parse_known_args(argv)
    script_args, training_args, model_args = recipe.make_parser().parse_args_and_config([
        "--config", args.recipe, "--max_steps", str(args.steps), "--eval_strategy", "no", "--eval_on_start", "false",
        "--save_strategy", "no",
        "--report_to", "none", "--logging_steps", "1", "--output_dir", "/tmp/step_breakdown", *overrides,
    ])
    timer = StageTimer()
    if args.trainer == "opd":
        trainer = recipe.build_trainer(script_args, training_args, model_args)
        timer.wrap(trainer.teacher, "score", "teacher scoring")
        # the outermost stage first: input preparation (generation and scoring inside it) is not the update
        timer.wrap(trainer, "_prepare_inputs", "preparation")
        timer.wrap(trainer, "training_step", "student update", subtract=("preparation",))
    else:
        trainer = trl_distillation_trainer(script_args, training_args, model_args)
        teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
        timer.wrap(trainer, "_get_last_hidden_state", "teacher scoring", when=lambda model, *a, **k: model is teacher)
        timer.wrap(trainer, "_prepare_inputs", "preparation")
        timer.wrap(trainer, "training_step", "student update", subtract=("preparation", "teacher scoring"))
    timer.wrap(trainer, "_generate", "generation")
    optimizer_start, logs_by_step = [], []

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

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "loss" in logs:  # a step's log (not the run's summary)
                logs_by_step.append(dict(logs))

    trainer.add_callback(Steps())
    trainer.train()

    per_generation = max(1, (trainer.args.steps_per_generation or 1) // trainer.args.gradient_accumulation_steps)
    warm_up = per_generation if len(timer.steps) > per_generation else 0
    measured = timer.steps[warm_up:]
    mean = {key: sum(step.get(key, 0.0) for step in measured) / len(measured)
            for key in ("step", *STAGES)}
    essential = sum(mean[stage] for stage in STAGES)
    rows = {stage: mean[stage] for stage in STAGES}
    rows["everything else"] = mean["step"] - essential
    result = {"trainer": args.trainer, "recipe": args.recipe, "overrides": overrides, "steps_measured": len(measured),
              "seconds_per_step": mean["step"], "stages": rows, "overhead_ratio": mean["step"] / essential,
              "generation_share": mean["generation"] / mean["step"],
              "steps_per_generation": trainer.args.steps_per_generation,
              "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
              **throughput(logs_by_step, warm_up, sum(step["step"] for step in measured),
                           trainer.accelerator.num_processes, trainer.args.max_completion_length)}
    print(f"{args.trainer}: {len(measured)} steps after the first, {mean['step']:.2f} s per step:")
    for stage, seconds in rows.items():
        print(f"  {stage:<16} {seconds:7.2f} s  {seconds / mean['step']:6.1%}")
    print(f"  step / (generation + scoring + update) = {result['overhead_ratio']:.3f}")
    if result["tokens_per_second_per_process"] is not None:
        print(f"  {result['tokens_per_second_per_process']:.0f} tokens/s per process; completions "
              f"{result['completion_mean_length']:.0f} tokens on average of at most {result['max_completion_length']} "
              f"({result['completion_clipped_ratio']:.0%} cut at the limit)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


def throughput(logs: list[dict], warm_up: int, seconds: float, processes: int, max_length: int) -> dict:
    """Tokens per second per process over the steps after `warm_up`, and the completions' mean length and clipped
    share there. GRPO's `num_tokens` counts every process's prompt and completion tokens, cumulatively, and is logged
    only by a step that generated (like the completions' lengths), so it is carried over the steps that did not."""
    seen, tokens = 0, []
    for log in logs:
        seen = log.get("num_tokens", seen)
        tokens.append(seen)
    generated = [log for log in logs[warm_up:] if "completions/mean_length" in log]
    if not generated or seconds <= 0:
        return {"tokens_per_second_per_process": None, "completion_mean_length": None,
                "completion_clipped_ratio": None, "max_completion_length": max_length}
    before = tokens[warm_up - 1] if warm_up else 0
    mean = lambda key: sum(log[key] for log in generated) / len(generated)
    return {"tokens_per_second_per_process": (tokens[-1] - before) / seconds / processes,
            "completion_mean_length": mean("completions/mean_length"),
            "completion_clipped_ratio": mean("completions/clipped_ratio"), "max_completion_length": max_length}


def trl_distillation_trainer(script_args, training_args, model_args):
    """TRL's DistillationTrainer (reverse KL, on-policy) with the recipe's models, data and training settings."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl import DistillationConfig, DistillationTrainer, get_peft_config

    from trl_opd.models_dir import resolve_model
    from trl_opd.tools import recipe

    same = ("max_steps", "learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps", "seed",
            "max_completion_length", "temperature", "logging_steps", "lr_scheduler_type", "warmup_steps",
            "weight_decay", "bf16", "activation_checkpointing", "save_strategy", "report_to", "output_dir",
            "disable_dropout")
    config = DistillationConfig(**{name: getattr(training_args, name) for name in same}, beta=1.0)
    dtype = getattr(torch, model_args.dtype) if model_args.dtype not in (None, "auto") else torch.float32
    student, teacher = (resolve_model(name) for name in (model_args.model_name_or_path,
                                                          training_args.teacher_model_name_or_path))
    return DistillationTrainer(
        model=AutoModelForCausalLM.from_pretrained(student, dtype=dtype),
        teacher_model=AutoModelForCausalLM.from_pretrained(teacher, dtype=dtype),
        args=config,
        train_dataset=recipe.load_prompts(script_args, script_args.dataset_train_split),
        peft_config=get_peft_config(model_args),
    )


if __name__ == "__main__":
    sys.exit(main())
