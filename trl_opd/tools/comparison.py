"""OPD against the alternatives on one task: TRL's DistillationTrainer, GRPO with the task's reward, SFT on the
teacher's answers. Same student, teacher, prompts, completions per step, learning rate and steps for each.

Every `eval_every` steps the student is measured the same way whatever trained it (`HeldoutReverseKLCallback`):
accuracy and exact reverse KL(student || teacher) on student samples for held-out prompts. Generated tokens are
counted where they are generated: the student's `generate` for the on-policy methods, the teacher's for SFT (all of
its answers are generated before training, and the x axis charges them as they are consumed).

    run = run_method("opd", **task_inputs("artifacts/tiny_task"), steps=200)
    run["history"]  # [{"step", "train_seconds", "generated_tokens", "accuracy", "reverse_kl_exact", ...}, ...]
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from ..evaluation import HeldoutReverseKLCallback

METHODS = ("opd", "opd-forward-kl", "opd-jsd", "opd-sampled", "opd-control", "trl-distillation", "grpo", "sft")
# OPDTrainer's settings per OPD method: its defaults (the full-vocabulary reverse KL here), the same term with another
# divergence (TRL's beta: 0 forward KL, 0.5 the generalised JSD halfway), the sampled-token estimator, and its control
# (the same run with every token's advantage the constant -mean|A|: does the teacher's per-token signal matter?)
_OPD_SETTINGS = {"opd": {}, "opd-forward-kl": {"opd_divergence_beta": 0.0}, "opd-jsd": {"opd_divergence_beta": 0.5},
                 "opd-sampled": {"opd_estimator": "sampled"},
                 "opd-control": {"opd_estimator": "sampled", "opd_constant_advantage": True}}


class _GeneratedTokens:
    """Wraps `model.generate` to count the new non-pad tokens it returns, except while `paused` (evaluation)."""

    def __init__(self, model, pad_token_id: int):
        self.total, self.paused, generate = 0, False, model.generate

        def counting_generate(*args, **kwargs):
            out = generate(*args, **kwargs)
            if not self.paused:
                sequences = out.sequences if hasattr(out, "sequences") else out
                prompt = kwargs.get("input_ids", args[0] if args else None)
                self.total += int((sequences[:, prompt.size(1) :] != pad_token_id).sum())
            return out

        model.generate = counting_generate


class _CurveCallback(HeldoutReverseKLCallback):
    """Held-out metrics plus the tokens generated so far, `generated_tokens(step)`; the student's own evaluation
    samples are not counted."""

    def __init__(self, *args, counter: _GeneratedTokens, generated_tokens, **kwargs):
        super().__init__(*args, **kwargs)
        self.counter, self.generated_tokens = counter, generated_tokens

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        super().on_train_begin(args, state, control, model=model, **kwargs)
        self.history[-1][1].setdefault("generated_tokens", 0)  # where `initial` was given, not measured

    def _evaluate(self, step: int, model) -> dict[str, float]:
        self.counter.paused = True
        try:
            metrics = super()._evaluate(step, model)
        finally:
            self.counter.paused = False
        metrics["generated_tokens"] = self.generated_tokens(step)
        return metrics


def _teacher_answers(teacher, tokenizer, prompts: list, *, max_new_tokens: int, seed: int) -> tuple[list, list[int]]:
    """The teacher's sampled answers (temperature 1) to `prompts`, and the tokens each took."""
    from ..envs.addition import completion_texts

    texts, lengths = completion_texts(teacher, tokenizer, prompts, max_new_tokens=max_new_tokens, do_sample=True,
                                      seed=seed, with_lengths=True)
    return [[{"role": "assistant", "content": t}] for t in texts], lengths


def describe_machine() -> str:
    """The CPU benchmarks ran on, as a table caption names it: "2-core AMD EPYC" (torch picks different kernels on
    different CPUs, so trajectories differ from one to another)."""
    import os
    import platform

    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        model = names[0] if names else model
    return f"{os.cpu_count()}-core {model}"


def task_inputs(task_dir: str | Path) -> dict:
    """`run_method`'s model and data arguments for a task directory built by `make_tiny_task`."""
    from datasets import load_dataset

    task_dir = Path(task_dir)
    return {"student": str(task_dir / "student"), "teacher": str(task_dir / "teacher"),
            "prompts": load_dataset("json", data_files=str(task_dir / "train.jsonl"), split="train"),
            "heldout": [json.loads(line) for line in open(task_dir / "heldout.jsonl")]}


def run_method(method: str, student: str, teacher: str, prompts, heldout: list[dict], *, steps: int = 200,
               batch_size: int = 32, learning_rate: float = 1e-3, eval_every: int = 25, eval_prompts: int = 100,
               seed: int = 0, max_completion_length: int = 40, grpo_generations: int = 8, dtype: str = "float32",
               output_dir: str | None = None, accuracy_func=None, lora_r: int | None = None,
               greedy_accuracy: bool = False, initial: dict | None = None) -> dict:
    """Train `student` (a path or Hub id) with `method` (one of `METHODS`) on `prompts` (a dataset with `prompt` and
    `solution` columns, as in `task_inputs`) and return its learning curve on `heldout` rows (prompt, solution).

    `accuracy_func` scores answers (GRPO's reward and the held-out accuracy; TRL's `accuracy_reward` by default);
    with `lora_r`, every method trains a LoRA adapter of that rank (alpha 2r, all linear layers) instead of the whole
    student; with `greedy_accuracy`, each evaluation also scores the student's greedy answers (`accuracy_greedy`);
    `initial`, the untrained student's held-out metrics measured once for a sweep, is its curve's first point instead
    of a measurement (`HeldoutReverseKLCallback`)."""
    import torch
    from datasets import Dataset, concatenate_datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.rewards import accuracy_reward

    from ..config import ACTIVATION_CHECKPOINTING

    accuracy_func = accuracy_func or accuracy_reward
    peft = {}
    if lora_r:
        from peft import LoraConfig

        peft["peft_config"] = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules="all-linear",
                                         task_type="CAUSAL_LM")

    if method not in METHODS:
        raise ValueError(f"Unknown method {method!r}; choose from {METHODS}.")
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(student)
    student = AutoModelForCausalLM.from_pretrained(student, dtype=getattr(torch, dtype))
    teacher = AutoModelForCausalLM.from_pretrained(teacher, dtype=getattr(torch, dtype)).eval()
    heldout = heldout[:eval_prompts]
    common = dict(max_steps=steps, learning_rate=learning_rate, per_device_train_batch_size=batch_size, seed=seed,
                  logging_steps=eval_every, save_strategy="no", report_to="none",
                  **{ACTIVATION_CHECKPOINTING: False}, disable_tqdm=True, bf16=dtype == "bfloat16")
    generation = dict(max_completion_length=max_completion_length, temperature=1.0)
    counter, teacher_seconds = _GeneratedTokens(student, tokenizer.pad_token_id), 0.0
    generated_tokens = lambda step: counter.total  # noqa: E731 (the student's samples so far; SFT's is below)
    with tempfile.TemporaryDirectory() as scratch:
        common["output_dir"] = output_dir or scratch
        if method.startswith("opd"):
            from .. import OPDConfig, OPDTrainer

            trainer = OPDTrainer(model=student, teacher_model=teacher, train_dataset=prompts,
                                 processing_class=tokenizer, **peft,
                                 args=OPDConfig(num_generations=1, **_OPD_SETTINGS[method], **generation, **common))
        elif method == "trl-distillation":
            from trl import DistillationConfig, DistillationTrainer

            trainer = DistillationTrainer(model=student, teacher_model=teacher, train_dataset=prompts,
                                          processing_class=tokenizer, **peft,
                                          args=DistillationConfig(**generation, **common))
        elif method == "grpo":
            from trl import GRPOConfig, GRPOTrainer

            trainer = GRPOTrainer(model=student, reward_funcs=accuracy_func, train_dataset=prompts,
                                  processing_class=tokenizer, **peft,
                                  args=GRPOConfig(num_generations=grpo_generations, **generation, **common))
        else:
            from trl import SFTConfig, SFTTrainer

            # one answer per training row; with more rows than prompts, the teacher answers prompts again
            answers = steps * batch_size
            repeats = [prompts] * ((answers - 1) // len(prompts))
            rows = concatenate_datasets([prompts.shuffle(seed=seed), *repeats]).select(range(answers))
            begin = time.perf_counter()
            completions, lengths = _teacher_answers(teacher, tokenizer, rows["prompt"],
                                                    max_new_tokens=max_completion_length, seed=seed)
            teacher_seconds = time.perf_counter() - begin
            data = Dataset.from_dict({"prompt": rows["prompt"], "completion": completions})
            trainer = SFTTrainer(model=student, train_dataset=data, processing_class=tokenizer, **peft,
                                 args=SFTConfig(shuffle_dataset=False, **common))
            generated_tokens = lambda step: sum(lengths[: step * batch_size])  # noqa: E731 (answers consumed)
        callback = _CurveCallback(
            teacher, tokenizer, [row["prompt"] for row in heldout], eval_every=eval_every,
            max_new_tokens=max_completion_length, seed=1234, solutions=[row["solution"] for row in heldout],
            accuracy_func=accuracy_func, counter=counter, generated_tokens=generated_tokens,
            greedy_accuracy=greedy_accuracy, initial=initial,
        )
        trainer.add_callback(callback)
        begin = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - begin
    history = [{"step": step, **metrics} for step, metrics in callback.history]
    train_seconds = history[-1]["train_seconds"] if history and history[-1]["step"] == steps else seconds
    return {"method": method, "seed": seed, "steps": steps, "history": history,
            "log_history": trainer.state.log_history, "seconds_per_step": train_seconds / steps,
            "teacher_generation_seconds": teacher_seconds,
            "generated_tokens": history[-1]["generated_tokens"] if history else 0}


def summarize(runs: list[dict], *, target: float) -> dict[str, dict]:
    """Per method, means over seeds: final accuracy and KL (with their ranges over seeds), seconds per step, and the
    generated tokens, steps and training seconds at which held-out accuracy first reached `target` (None if it did
    not)."""
    import statistics

    def first_reaching(run: dict, key: str):
        return next((entry[key] for entry in run["history"] if entry["accuracy"] >= target), None)

    table = {}
    for method in dict.fromkeys(run["method"] for run in runs):
        group = [run for run in runs if run["method"] == method]
        reached = [first_reaching(run, "generated_tokens") for run in group]
        accuracy = [run["history"][-1]["accuracy"] for run in group]
        reverse_kl = [run["history"][-1]["reverse_kl_exact"] for run in group]
        row = {
            "seeds": len(group),
            "accuracy_range": (min(accuracy), max(accuracy)),
            "reverse_kl_range": (min(reverse_kl), max(reverse_kl)),
            "accuracy": statistics.mean(accuracy),
            "accuracy_before": statistics.mean(run["history"][0]["accuracy"] for run in group),
            "reverse_kl": statistics.mean(reverse_kl),
            "reverse_kl_before": statistics.mean(run["history"][0]["reverse_kl_exact"] for run in group),
            "seconds_per_step": statistics.mean(run["seconds_per_step"] for run in group),
            "reached": sum(r is not None for r in reached),
            "tokens_to_target": statistics.mean(reached) if all(r is not None for r in reached) else None,
            "steps_to_target": None, "seconds_to_target": None,
        }
        if row["tokens_to_target"] is not None:
            row["steps_to_target"] = statistics.mean(first_reaching(run, "step") for run in group)
            row["seconds_to_target"] = statistics.mean(first_reaching(run, "train_seconds") for run in group)
        if all("peak_rss_mib" in run for run in group):
            row["peak_rss_mib"] = statistics.mean(run["peak_rss_mib"] for run in group)
        table[method] = row
    return table


def best_learning_rates(runs: list[dict]) -> dict[str, float | None]:
    """Per method, the learning rate with the best mean final held-out accuracy over seeds, then the lower mean final
    KL (None for runs that record no `learning_rate`)."""
    sweep = summarize([{**run, "method": (run["method"], run.get("learning_rate"))} for run in runs], target=1.0)
    best = {}
    for (method, rate), row in sweep.items():
        score = (row["accuracy"], -row["reverse_kl"])
        if method not in best or score > best[method][0]:
            best[method] = (score, rate)
    return {method: rate for method, (_, rate) in best.items()}


def at_best_rate(runs: list[dict]) -> list[dict]:
    """The runs of each method at its best learning rate (`best_learning_rates`): what the README and
    docs/benchmarks.md report for a sweep over rates."""
    rates = best_learning_rates(runs)
    return [run for run in runs if run.get("learning_rate") == rates[run["method"]]]


def plot_comparison(runs: list[dict], *, target: float | None = None, path: str | Path | None = None):
    """Held-out accuracy against generated tokens and training seconds, and reverse KL against steps, one line per
    method (mean over seeds). Saved to `path` if given; returns the matplotlib figure."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = [("generated_tokens", "accuracy", "generated tokens"), ("train_seconds", "accuracy", "training seconds"),
              ("step", "reverse_kl_exact", "step")]
    for method in dict.fromkeys(run["method"] for run in runs):
        group = [run["history"] for run in runs if run["method"] == method]
        length = min(len(history) for history in group)
        for axis, (x_key, y_key, _) in zip(axes, panels, strict=True):
            x = np.mean([[entry[x_key] for entry in history[:length]] for history in group], axis=0)
            y = np.mean([[entry[y_key] for entry in history[:length]] for history in group], axis=0)
            axis.plot(x, y, marker=".", label=method)
    for axis, (_, y_key, x_label) in zip(axes, panels, strict=True):
        axis.set(xlabel=x_label, ylabel={"accuracy": "held-out accuracy"}.get(y_key, "held-out KL(student || teacher)"))
        axis.grid(alpha=0.3)
    axes[2].set_yscale("log")
    if target is not None:
        for axis in axes[:2]:
            axis.axhline(target, color="grey", linestyle="--", linewidth=1, label="teacher - 5 points")
    axes[0].legend()
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
