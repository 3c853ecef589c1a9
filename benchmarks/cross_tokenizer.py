"""OPD from a teacher of another model family (`teacher_tokenizer_mode: cross`), before and after a short run.

Two pairs, each trained with the sampled estimator (the one a cross-tokenizer teacher supports):
- `tiny`, a locally built pair with a known gap: the addition task's student (digits one per token, ChatML) from the
  task's own teacher (the same tokenizer) and from a teacher of another family trained the same way on the same rows
  (`make_other_family_teacher`: multi-digit number tokens, other special tokens and chat template), the latter with
  each credit (`teacher_cross_credit`: `byte`, the default, and `chunk`). Same steps, batch, learning rate and seed
  for all.
- `real`: SmolLM2-135M-Instruct (its 49,152-token tokenizer, LoRA) from Qwen2.5-Coder-0.5B-Instruct (151,936 tokens)
  on the code task (what a short Python program prints), by Hub id: read from their copies in OPD_MODELS_DIR where it
  is set (`trl_opd.models_dir`).

Measured on held-out prompts, before and after, the same way whatever the teacher's tokenizer
(`trl_opd.evaluation.heldout_text_reverse_kl`): KL(student || teacher) of the student's sampled completions,
log pi_S(text) - log pi_T(text) with the teacher reading its own rendering of the prompt, per completion (the
quantity OPD lowers) and per character; the accuracy of the same samples and of the student's greedy answers.

    .venv/bin/trl-opd make-tiny-task artifacts/tiny_task
    .venv/bin/python benchmarks/cross_tokenizer.py --pair tiny --steps 300
    make real-models && .venv/bin/trl-opd make-code-task artifacts/code_task
    export OPD_MODELS_DIR=~/.cache/real-models      # offline: where `make real-models` put the Hub's models
    .venv/bin/python benchmarks/cross_tokenizer.py --pair real --steps 24 --eval-prompts 100
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PAIRS = {
    "tiny": dict(task="artifacts/tiny_task", student="student",
                 arms={"same tokenizer": ("teacher", "same", None),
                       "other family": ("teacher_other", "cross", "byte"),
                       "other family, chunk credit": ("teacher_other", "cross", "chunk")},
                 learning_rate=1e-4, batch_size=32, max_completion_length=40, lora_r=None),
    "real": dict(task="artifacts/code_task", student="HuggingFaceTB/SmolLM2-135M-Instruct",
                 arms={"other family": ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "cross", "byte"),
                       "other family, chunk credit": ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "cross", "chunk")},
                 learning_rate=5e-4, batch_size=8, max_completion_length=16, lora_r=8),
}


def accuracy_func(pair: str):
    if pair == "real":
        from trl_opd.envs.code_output import printed_output_reward

        return printed_output_reward
    from trl.rewards import accuracy_reward

    return accuracy_reward


def evaluate(student, tokenizer, teacher, teacher_tokenizer, heldout: list[dict], args, pair: str) -> dict:
    from trl_opd.evaluation import heldout_text_reverse_kl

    begin = time.perf_counter()
    metrics = heldout_text_reverse_kl(
        student, tokenizer, teacher, teacher_tokenizer, [row["prompt"] for row in heldout], seed=1234,
        max_new_tokens=PAIRS[pair]["max_completion_length"], solutions=[row["solution"] for row in heldout],
        accuracy_func=accuracy_func(pair), greedy_accuracy=True,
    )
    return {**metrics, "seconds": time.perf_counter() - begin}


def run_arm(pair: str, arm: str, args) -> dict:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_opd import OPDConfig, OPDTrainer
    from trl_opd.models_dir import resolve_model

    settings = PAIRS[pair]
    task = Path(settings["task"])
    student_path = str(task / settings["student"]) if pair == "tiny" else settings["student"]
    teacher_name, mode, credit = settings["arms"][arm]
    teacher_path = str(task / teacher_name) if pair == "tiny" else teacher_name
    student_dir, teacher_dir = resolve_model(student_path), resolve_model(teacher_path)  # the JSON keeps the names
    prompts = load_dataset("json", data_files=str(task / "train.jsonl"), split="train")
    heldout = [json.loads(line) for line in open(task / "heldout.jsonl")][: args.eval_prompts]
    tokenizer = AutoTokenizer.from_pretrained(student_dir, padding_side="left")
    teacher_tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    torch.manual_seed(args.seed)
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    before = evaluate(student, tokenizer, teacher, teacher_tokenizer, heldout, args, pair)

    peft = {}
    if settings["lora_r"]:
        from peft import LoraConfig

        r = settings["lora_r"]
        peft["peft_config"] = LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", task_type="CAUSAL_LM")
    config = OPDConfig(
        output_dir=str(Path(args.workdir) / f"{pair}-{mode}-{credit}"), max_steps=args.steps, num_generations=1,
        per_device_train_batch_size=settings["batch_size"], learning_rate=settings["learning_rate"],
        max_completion_length=settings["max_completion_length"], temperature=1.0, opd_estimator="sampled",
        teacher_tokenizer_mode=mode, teacher_cross_credit=credit, seed=args.seed, kl_discount_factor=args.kl_discount,
        logging_steps=max(args.steps // 4, 1), save_strategy="no",
        report_to="none", bf16=False, activation_checkpointing=False, disable_dropout=True, disable_tqdm=True,
        overwrite_output_dir=True,
    )
    trainer = OPDTrainer(model=student, teacher_model=teacher, args=config, train_dataset=prompts,
                         processing_class=tokenizer, teacher_processing_class=teacher_tokenizer, **peft)
    begin = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - begin
    after = evaluate(trainer.model, tokenizer, teacher, teacher_tokenizer, heldout, args, pair)
    logged = [entry for entry in trainer.state.log_history if "opd/reverse_kl" in entry]
    return {"pair": pair, "arm": arm, "mode": mode, "credit": credit, "student": student_path, "teacher": teacher_path,
            "steps": args.steps, "seconds_per_step": seconds / args.steps, "before": before, "after": after,
            "chunk_tokens_logged": [entry.get("opd/aligned_chunk_tokens_mean") for entry in logged],
            "unaligned_logged": [entry.get("opd/unaligned_token_fraction") for entry in logged]}


def print_table(results: dict) -> None:
    from trl_opd.tools.comparison import describe_machine

    print(f"\n{results.get('machine', describe_machine())}, {results.get('date', '')}, seed {results['seed']}, "
          f"{results['eval_prompts']} held-out prompts\n")
    print("| pair | teacher | steps | KL(student ‖ teacher) per completion, before → after | per character | "
          "accuracy, greedy | accuracy, sampled | student tokens per chunk | s/step |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for run in results["runs"]:
        before, after = run["before"], run["after"]
        greedy = (f"{before['accuracy_greedy']:.1%} → {after['accuracy_greedy']:.1%}" if "accuracy_greedy" in after
                  else "")
        print(f"| {run['pair']} | {run['arm']} ({Path(run['teacher']).name}) | {run['steps']} | "
              f"{before['reverse_kl_per_sequence']:.2f} → {after['reverse_kl_per_sequence']:.2f} | "
              f"{before['reverse_kl_per_char']:.3f} → {after['reverse_kl_per_char']:.3f} | {greedy} | "
              f"{before['accuracy']:.1%} → {after['accuracy']:.1%} | {after['chunk_tokens']:.2f} | "
              f"{run['seconds_per_step']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="tiny")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-completion-length", type=int, default=None, help="default: the pair's")
    parser.add_argument("--learning-rate", type=float, default=None, help="default: the pair's")
    parser.add_argument("--arms", nargs="*", default=None, help="default: all of the pair's")
    parser.add_argument("--kl-discount", type=float, default=0.0,
                        help="kl_discount_factor: 0 a per-token advantage, above 0 a discounted return-to-go")
    parser.add_argument("--workdir", default="artifacts/cross_tokenizer")
    parser.add_argument("--json", default=None, help="default: benchmarks/results/cross_tokenizer_<pair>.json")
    parser.add_argument("--from-json", action="store_true", help="print the table of a saved run")
    args = parser.parse_args()
    path = Path(args.json or f"benchmarks/results/cross_tokenizer_{args.pair}.json")
    if args.from_json:
        print_table(json.loads(path.read_text()))
        return

    from trl_opd.tools.comparison import describe_machine

    if args.pair == "tiny":
        from trl_opd.envs.addition import make_other_family_teacher

        make_other_family_teacher(PAIRS["tiny"]["task"])
    results = {"machine": describe_machine(), "date": time.strftime("%Y-%m-%d"), "seed": args.seed,
               "eval_prompts": args.eval_prompts, "kl_discount_factor": args.kl_discount, "runs": []}
    if args.pair == "tiny":
        results["task_accuracy"] = json.loads((Path(PAIRS["tiny"]["task"]) / "accuracy.json").read_text())
    for key in ("max_completion_length", "learning_rate"):
        if getattr(args, key):
            PAIRS[args.pair][key] = getattr(args, key)
    for arm in args.arms or PAIRS[args.pair]["arms"]:
        results["runs"].append(run_arm(args.pair, arm, args))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")
    print_table(results)


if __name__ == "__main__":
    main()
