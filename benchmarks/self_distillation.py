"""Self-distillation with privileged context: OPD's `student_as_teacher` against TRL's SDFT trainer, side by side.

The student is its own teacher, and only the teacher reads the row's reference answer: the teacher's user message is
the student's followed by the answer (`teacher_prompt_template`, "{prompt}\\n\\n<hint> {solution}"). Each kind of
teacher (its initial weights, its live weights, a moving average of them) is trained by both trainers, on the same
student, prompts, seed, learning rate, steps and teacher prompt:
- OPD: `OPDTrainer` with `student_as_teacher` (initial, live, ema) and `opd_estimator="topk"` (the reverse KL over
  the teacher's top-k tokens and one tail bucket, at every completion position);
- SDFT: `trl.experimental.sdft.SDFTTrainer` with `teacher_model_kind` (base, live, ema) and the same objective:
  `distillation_mode="topk_logits"` with the same k, `distillation_add_tail=True`, `distillation_alpha=1.0` (reverse
  KL); the rest at its defaults (its importance-ratio clip at 2.0);
- and, as the target, OPD from the bigger teacher of the pair with no context (`opd-teacher`, OPD's default estimator).
The 'ema' kind moves `--ema-rate` of the way to the student after every optimizer step in both.

Pairs:
- `tiny`: the addition task's student from itself (full fine-tuning; the bigger teacher: the task's), batch 32,
  completions of at most 40 tokens, 300 steps, 200 held-out prompts;
- `real`: Qwen2.5-Coder-0.5B-Instruct (LoRA r 8, alpha 16, all linear layers) from itself on the code task (what a
  short Python program prints; the bigger teacher: Qwen2.5-Coder-1.5B-Instruct), batch 8, completions of at most 16
  tokens, 24 steps, 100 held-out prompts; by Hub id, read from OPD_MODELS_DIR where it is set.

Measured before and after, the same way for every run: the student's held-out accuracy, greedy and sampled at
temperature 1 (with the binomial standard error), and, before training, the accuracy of the student reading the
teacher's prompt (what the self-teacher knows) and of the bigger teacher. Each run trains in a fresh subprocess of
this script, which records the seconds per step of `trainer.train()` and the growth of its resident memory in
training (`gold_comparison.py`'s measure).

    .venv/bin/trl-opd make-tiny-task artifacts/tiny_task
    .venv/bin/python benchmarks/self_distillation.py --pair tiny
    make real-models && .venv/bin/trl-opd make-code-task artifacts/code_task
    export OPD_MODELS_DIR=~/.cache/real-models      # offline: where `make real-models` put the Hub's models
    .venv/bin/python benchmarks/self_distillation.py --pair real
    .venv/bin/python benchmarks/self_distillation.py --pair real --from-json   # the table of a saved run

`--resume` keeps the runs already in the JSON file (same settings) and adds the missing ones. Results go to
benchmarks/results/self_distillation_<pair>.json (`--json` elsewhere), rewritten after each run. Run it alone: with
another process on the same cores, steps run many times slower.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cross_tokenizer import accuracy_func  # noqa: E402 (the benchmarks folder is not a package)
from gold_comparison import (  # noqa: E402
    current_rss_mb,
    order_digest,
    peak_rss_mb,
    reset_peak_rss,
    results_file,
    shared_settings,
    weights_digest,
)

KINDS = {"initial": "base", "live": "live", "ema": "ema"}  # OPD's student_as_teacher -> SDFT's teacher_model_kind
ARMS = (*(f"opd-{kind}" for kind in KINDS), *(f"sdft-{kind}" for kind in KINDS), "opd-teacher")
PAIRS = {
    "tiny": dict(task="artifacts/tiny_task", student="student", teacher="teacher", lora_r=None, batch_size=32,
                 max_completion_length=40, steps=300, eval_prompts=200, learning_rate=1e-4,
                 hint="The answer is {solution}."),
    "real": dict(task="artifacts/code_task", student="Qwen/Qwen2.5-Coder-0.5B-Instruct",
                 teacher="Qwen/Qwen2.5-Coder-1.5B-Instruct", lora_r=8, batch_size=8, max_completion_length=16,
                 steps=24, eval_prompts=100, learning_rate=2e-4, hint="The expected output is: {solution}"),
}
LOGGED = ("step", "loss", "grad_norm", "opd/reverse_kl", "opd/reverse_kl_topk", "self_distillation/distillation_loss")


def model_dirs(pair: str) -> tuple[str, str]:
    from trl_opd.models_dir import resolve_model

    settings = PAIRS[pair]
    if pair == "tiny":
        return str(Path(settings["task"]) / settings["student"]), str(Path(settings["task"]) / settings["teacher"])
    return resolve_model(settings["student"]), resolve_model(settings["teacher"])


def rows_of(pair: str, split: str, count: int | None = None) -> list[dict]:
    with open(Path(PAIRS[pair]["task"]) / f"{split}.jsonl") as lines:
        return [json.loads(line) for line in lines][:count]


def with_hint(prompt: list[dict], solution: str, pair: str) -> list[dict]:
    """The teacher's prompt: `prompt` with the hint after its last user message, as both trainers build it."""
    hint = PAIRS[pair]["hint"].format(solution=solution)
    return [*prompt[:-1], {**prompt[-1], "content": f"{prompt[-1]['content']}\n\n{hint}"}]


def accuracy(model, tokenizer, prompts: list, solutions: list[str], pair: str, *, sampled: bool, seed: int) -> dict:
    from trl_opd.envs.addition import completion_texts

    begin = time.perf_counter()
    texts = completion_texts(model, tokenizer, prompts, max_new_tokens=PAIRS[pair]["max_completion_length"],
                             do_sample=sampled, seed=seed)
    scores = accuracy_func(pair)(completions=[[{"role": "assistant", "content": t}] for t in texts],
                                 solution=solutions, prompts=prompts)
    p = sum(score or 0.0 for score in scores) / len(scores)
    return {"accuracy": p, "stderr": math.sqrt(p * (1 - p) / len(scores)), "n": len(scores),
            "seconds": time.perf_counter() - begin, "example": texts[0]}


def evaluate(model, tokenizer, pair: str, args, *, hinted: bool = False) -> dict:
    heldout = rows_of(pair, "heldout", args.eval_prompts)
    prompts = [with_hint(row["prompt"], row["solution"], pair) if hinted else row["prompt"] for row in heldout]
    solutions = [row["solution"] for row in heldout]
    return {way: accuracy(model, tokenizer, prompts, solutions, pair, sampled=way == "sampled", seed=args.eval_seed)
            for way in ("greedy", "sampled")}


def load(path: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
            AutoTokenizer.from_pretrained(path, padding_side="left"))


# ------------------------------------------------------------------ workers (each run in a fresh subprocess)


def work_before(args) -> dict:
    """The student before training, alone and reading the teacher's prompt, and the bigger teacher."""
    student_dir, teacher_dir = model_dirs(args.pair)
    student, tokenizer = load(student_dir)
    before = {"student": evaluate(student, tokenizer, args.pair, args),
              "student_with_context": evaluate(student, tokenizer, args.pair, args, hinted=True)}
    del student
    gc.collect()
    teacher, teacher_tokenizer = load(teacher_dir)
    before["teacher"] = evaluate(teacher, teacher_tokenizer, args.pair, args)
    return before


def work_train(args) -> dict:
    import transformers
    from datasets import Dataset

    pair, settings, arm = args.pair, PAIRS[args.pair], args.arm
    student_dir, teacher_dir = model_dirs(pair)
    student, tokenizer = load(student_dir)
    rows = rows_of(pair, "train")
    peft, common = shared_settings(settings, args, f"{pair}-{arm}")
    hint = settings["hint"]
    transformers.set_seed(args.seed)  # the same LoRA initialisation for every arm
    trainer_name, _, kind = arm.partition("-")
    if trainer_name == "opd":
        from trl_opd import OPDConfig, OPDTrainer

        if kind == "teacher":
            config, teacher = OPDConfig(**common), load(teacher_dir)[0].eval()
        else:
            ema = dict(teacher_ema_rate=args.ema_rate) if kind == "ema" else {}
            config = OPDConfig(**common, student_as_teacher=kind, opd_estimator="topk", opd_topk=args.topk,
                               teacher_prompt_template="{prompt}\n\n" + hint, **ema)
            teacher = None
        trainer = OPDTrainer(model=student, teacher_model=teacher, args=config, train_dataset=Dataset.from_list(rows),
                             processing_class=tokenizer, **peft)
    else:
        from trl.experimental.sdft import SDFTConfig, SDFTTrainer

        config = SDFTConfig(
            **common, teacher_model_kind=KINDS[kind], teacher_update_rate=args.ema_rate, teacher_sync_steps=1,
            distillation_mode="topk_logits", distillation_topk=args.topk, distillation_add_tail=True,
            distillation_alpha=1.0, teacher_prompt_template="{prompt}\n\n" + hint.replace("{solution}",
                                                                                          "{privileged_context}"),
        )
        data = [{"prompt": row["prompt"], "privileged_context": row["solution"]} for row in rows]
        trainer = SDFTTrainer(model=student, args=config, train_dataset=Dataset.from_list(data),
                              processing_class=tokenizer, **peft)
    checks = {"prompt_order_digest": order_digest(trainer, settings["batch_size"] * args.steps),
              "initial_weights_digest": weights_digest(trainer.model)}

    gc.collect()
    peak_reset = reset_peak_rss()
    rss_before, peak_before = current_rss_mb(), peak_rss_mb()
    begin = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - begin
    peak_after = peak_rss_mb()
    after = evaluate(trainer.model, tokenizer, pair, args)
    log = [{key: entry[key] for key in LOGGED if key in entry} for entry in trainer.state.log_history
           if "loss" in entry]
    return {"arm": arm, "learning_rate": args.learning_rate, "steps": args.steps, "train_seconds": seconds,
            "seconds_per_step": seconds / args.steps, "after": after, "rss_before_train_mb": rss_before,
            "peak_rss_mb": peak_after, "peak_rss_growth_mb": peak_after - rss_before,
            "peak_set_before_training": not peak_reset and peak_after <= peak_before, "checks": checks, "log": log}


# ------------------------------------------------------------------ orchestration


def run_worker(args, worker: str, arm: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--pair", args.pair, "--steps", str(args.steps),
                   "--eval-prompts", str(args.eval_prompts), "--seed", str(args.seed), "--eval-seed",
                   str(args.eval_seed), "--learning-rate", repr(args.learning_rate), "--topk", str(args.topk),
                   "--ema-rate", repr(args.ema_rate), "--workdir", args.workdir, "--worker", worker,
                   "--worker-output", str(output), *(["--arm", arm] if arm else [])]
        subprocess.run(command, check=True)
        return json.loads(output.read_text())


def settings_of(args) -> dict:
    settings = PAIRS[args.pair]
    return {**{key: settings[key] for key in ("task", "student", "teacher", "lora_r", "batch_size",
                                              "max_completion_length", "hint")},
            "steps": args.steps, "eval_prompts": args.eval_prompts, "eval_seed": args.eval_seed,
            "learning_rate": args.learning_rate, "topk": args.topk, "ema_rate": args.ema_rate,
            "temperature": 1.0, "top_p": 1.0, "top_k": 0, "num_generations": 1}


def _cell(metrics: dict) -> str:
    return f"{metrics['accuracy']:.1%} ± {metrics['stderr']:.1%}"


def print_table(results: dict) -> None:
    settings, before, runs = results["settings"], results["before"], results["runs"]
    print(f"\n{results['machine']}, {results['date']}, seed {results['seed']}: {Path(settings['student']).name} "
          f"from itself with the hint {settings['hint']!r} after the prompt, {settings['steps']} steps of "
          f"{settings['batch_size']} prompts at learning rate {settings['learning_rate']:g}, top-{settings['topk']} "
          f"reverse KL with a tail bucket, ema rate {settings['ema_rate']:g}; {settings['eval_prompts']} held-out "
          "prompts\n")
    print("| before training | accuracy, greedy | accuracy, sampled |\n|---|---:|---:|")
    for name, label in (("student", "the student"), ("student_with_context", "the student reading the hint"),
                        ("teacher", f"the bigger teacher ({Path(settings['teacher']).name})")):
        print(f"| {label} | {_cell(before[name]['greedy'])} | {_cell(before[name]['sampled'])} |")
    print("\n| trainer | teacher | accuracy, greedy, after | accuracy, sampled, after | s/step | "
          "peak memory growth (MB) |\n|---|---|---:|---:|---:|---:|")
    for run in sorted(runs, key=lambda r: ARMS.index(r["arm"])):
        trainer, _, kind = run["arm"].partition("-")
        teacher = ("the bigger teacher, no hint" if kind == "teacher" else
                   f"itself, {kind if trainer == 'opd' else KINDS[kind]}")
        print(f"| {'OPD' if trainer == 'opd' else 'SDFT'} | {teacher} | {_cell(run['after']['greedy'])} | "
              f"{_cell(run['after']['sampled'])} | {run['seconds_per_step']:.2f} | "
              f"{run['peak_rss_growth_mb']:.0f}{'*' if run['peak_set_before_training'] else ''} |")
    same = {key: len({run["checks"][key] for run in runs}) == 1 for key in ("prompt_order_digest",
                                                                           "initial_weights_digest")}
    print(f"\nSame prompts in the same order in every run: {'yes' if same['prompt_order_digest'] else 'NO'}; same "
          f"initial trainable weights: {'yes' if same['initial_weights_digest'] else 'NO'}.")
    if any(run["peak_set_before_training"] for run in runs):
        print("* the process's peak was set while loading, before training: an upper bound.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="tiny")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--steps", type=int, default=None, help="default: the pair's (tiny 300, real 24)")
    parser.add_argument("--eval-prompts", type=int, default=None, help="default: the pair's (tiny 200, real 100)")
    parser.add_argument("--learning-rate", type=float, default=None, help="default: the pair's (tiny 1e-4, real 2e-4)")
    parser.add_argument("--topk", type=int, default=20, help="k of both trainers' top-k term")
    parser.add_argument("--ema-rate", type=float, default=0.05, help="the 'ema' kind's rate in both trainers")
    parser.add_argument("--seed", type=int, default=0, help="training seed (prompt order, sampling, LoRA init)")
    parser.add_argument("--eval-seed", type=int, default=1234, help="seed of the held-out evaluation's samples")
    parser.add_argument("--workdir", default="artifacts/self_distillation")
    parser.add_argument("--json", default=None, help="default: benchmarks/results/self_distillation_<pair>.json")
    parser.add_argument("--resume", action="store_true", help="keep the runs already in the JSON (same settings)")
    parser.add_argument("--from-json", action="store_true", help="print the table of a saved run")
    parser.add_argument("--worker", choices=("before", "train"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-output", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--arm", choices=ARMS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    pair = PAIRS[args.pair]
    args.steps = args.steps or pair["steps"]
    args.eval_prompts = args.eval_prompts or pair["eval_prompts"]
    args.learning_rate = args.learning_rate or pair["learning_rate"]
    path = Path(args.json or f"benchmarks/results/self_distillation_{args.pair}.json")
    if args.from_json:
        print_table(json.loads(path.read_text()))
        return
    if args.worker:
        result = work_before(args) if args.worker == "before" else work_train(args)
        Path(args.worker_output).write_text(json.dumps(result))
        return

    results, save = results_file(path, settings_of(args), seed=args.seed, pair=args.pair, resume=args.resume)
    if results["before"] is None:
        results["before"] = run_worker(args, "before")
        save()
    done = {run["arm"] for run in results["runs"]}
    for arm in args.arms:
        if arm not in done:
            results["runs"].append(run_worker(args, "train", arm))
            save()
    print_table(results)


if __name__ == "__main__":
    main()
