"""Two-digit addition with a worked answer: an offline single-turn task, and a tiny teacher/student pair with a real
accuracy gap on it.

    What is 47 + 38?  ->  7 + 8 = 15. 4 + 3 + 1 = 8. The answer is \\boxed{85}.

Answers are checked by TRL's `accuracy_reward` (math-verify) against the `solution` column. One pair in ten, fixed by
`is_heldout(a, b)`, never appears in any training data (the teacher's, the student's or the prompts to train on), so
held-out accuracy measures the algorithm, not memory. The tokenizer splits digits one per token.

Both models are trained with TRL's `SFTTrainer` on worked answers: the teacher until it is nearly always right (at
least 95% of its held-out samples, `teacher_min_sampled`), the smaller student briefly, so that it has the format but
mostly wrong sums. `make_tiny_task` caches the result.

    trl-opd make-tiny-task artifacts/tiny_task     # about 2 minutes on 2 CPU cores, then cached
"""

from __future__ import annotations

import argparse
import json
import random
import zlib
from pathlib import Path

from ..tiny import CHAT_TEMPLATE, digit_split_bpe

# `seed` seeds the models' initialisation and SFT (student `seed`, teacher `seed + 1`); the data is the same for all.
# A teacher whose sampled held-out accuracy is under `teacher_min_sampled` after its steps trains on, a quarter of its
# steps at a quarter of the rate at a time, up to `teacher_max_rounds` times, and if it is still under, starts over
# from another initialisation, up to `teacher_max_inits` in all: a weaker teacher caps what OPD can reach
TASK_SETTINGS = {"student_hidden": 64, "student_steps": 150, "teacher_hidden": 96, "teacher_steps": 800, "lr": 5e-3,
                 "seed": 0, "teacher_min_sampled": 0.95, "teacher_max_rounds": 3, "teacher_max_inits": 2}


def is_heldout(a: int, b: int) -> bool:
    """The fixed tenth of (a, b) pairs kept out of every training set (by a hash of the whole pair, so that every
    digit fact still occurs in training, in other pairs)."""
    return zlib.crc32(f"{a}+{b}".encode()) % 10 == 0


def addition_row(a: int, b: int) -> dict:
    """One conversational prompt/completion row with its `solution`."""
    units = a % 10 + b % 10
    tens = a // 10 + b // 10 + units // 10
    worked = (f"{a % 10} + {b % 10} = {units}. {a // 10} + {b // 10} + {units // 10} = {tens}. "
              f"The answer is \\boxed{{{a + b}}}.")
    return {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
            "completion": [{"role": "assistant", "content": worked}], "solution": str(a + b)}


def addition_rows(n: int, seed: int, *, heldout: bool = False) -> list[dict]:
    """`n` random rows from the training pairs, or from the held-out pairs with `heldout`."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if is_heldout(a, b) == heldout:
            rows.append(addition_row(a, b))
    return rows


def addition_dataset(n: int, seed: int, *, heldout: bool = False):
    """`addition_rows` as a `datasets.Dataset` (columns prompt, completion, solution)."""
    from datasets import Dataset

    return Dataset.from_list(addition_rows(n, seed, heldout=heldout))


def build_task_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer with digits split one per token and a ChatML template."""
    corpus = [row["prompt"][0]["content"] + " " + row["completion"][0]["content"] for row in addition_rows(2000, 0)]
    tokenizer = digit_split_bpe(corpus, vocab_size=vocab_size)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def sft(model, tokenizer, dataset, *, steps: int, lr: float, seed: int, batch_size: int = 32, output_dir=None):
    """Train `model` in place with TRL's `SFTTrainer` on prompt/completion rows (loss on the completion only), with a
    linear decay to zero over `steps`; returns the trainer. One thread: faster than two for a model this small."""
    import tempfile

    import torch
    from trl import SFTConfig, SFTTrainer

    from ..config import ACTIVATION_CHECKPOINTING

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            config = SFTConfig(
                output_dir=output_dir or scratch, max_steps=steps, per_device_train_batch_size=batch_size,
                learning_rate=lr, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.01, seed=seed,
                logging_steps=max(steps // 5, 1), save_strategy="no", report_to="none", bf16=False,
                **{ACTIVATION_CHECKPOINTING: False}, disable_tqdm=False, dataloader_num_workers=0,
                dataloader_pin_memory=False,
            )
            trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
            trainer.train()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    return trainer


def completion_texts(model, tokenizer, prompts: list, *, max_new_tokens: int = 40, do_sample: bool = False,
                     seed: int = 0, batch_size: int = 128, with_lengths: bool = False):
    """The model's completions (special tokens stripped) to chat `prompts`, greedy or sampled at temperature 1 from
    the whole distribution (no top-k, top-p or repetition penalty a checkpoint's generation config may set); with
    `with_lengths`, also the number of tokens each took (its stop token included). A completion stops at any of the
    ids GRPO's training stops at (`stop_token_ids`)."""
    import torch

    from ..evaluation import stop_token_ids, until_first_stop

    stop = stop_token_ids(model, tokenizer)
    texts, lengths = [], []
    torch.manual_seed(seed)
    for start in range(0, len(prompts), batch_size):
        chunk = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                 for p in prompts[start : start + batch_size]]
        batch = tokenizer(chunk, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, do_sample=do_sample, temperature=1.0 if do_sample else None, top_k=0,
                                 top_p=1.0, repetition_penalty=1.0, max_new_tokens=max_new_tokens,
                                 eos_token_id=stop, pad_token_id=tokenizer.pad_token_id)
        completion = out[:, batch["input_ids"].size(1) :]
        texts += tokenizer.batch_decode(completion, skip_special_tokens=True)
        lengths += until_first_stop(completion, stop).sum(1).tolist()  # its first stop token included
    return (texts, lengths) if with_lengths else texts


def task_accuracy(model, tokenizer, rows: list[dict], *, do_sample: bool = False, seed: int = 0) -> float:
    """Fraction of `rows` the model answers right (TRL's `accuracy_reward`), greedy or sampled."""
    from trl.rewards import accuracy_reward

    texts = completion_texts(model, tokenizer, [row["prompt"] for row in rows], do_sample=do_sample, seed=seed)
    scores = accuracy_reward([[{"role": "assistant", "content": t}] for t in texts], [r["solution"] for r in rows])
    return sum(s or 0.0 for s in scores) / len(rows)


def _write_prompts(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps({"prompt": row["prompt"], "solution": row["solution"]}) + "\n")


def _train_teacher_on(teacher, tokenizer, sft_data, heldout, sampled: float, *, settings: dict,
                      seed: int) -> tuple[float, int]:
    """Train the teacher on while its sampled held-out accuracy is under `teacher_min_sampled`, a quarter of its steps
    at a quarter of the rate a round; returns its accuracy and the rounds it took."""
    rounds = 0
    while sampled < settings["teacher_min_sampled"] and rounds < settings["teacher_max_rounds"]:
        rounds += 1
        sft(teacher, tokenizer, sft_data, steps=settings["teacher_steps"] // 4, lr=settings["lr"] / 4,
            seed=seed + 100 * rounds)
        sampled = task_accuracy(teacher, tokenizer, heldout, do_sample=True)
    return sampled, rounds


def _build_teacher(teacher, tokenizer, sft_data, heldout, sampled: float, *, settings: dict, seed: int):
    """Train the teacher on (`_train_teacher_on`); if it stays under `teacher_min_sampled`, start over from another
    initialisation, up to `teacher_max_inits` in all, and keep the most accurate. Returns it, its sampled accuracy
    and how it was built."""
    from trl_opd.tiny import build_model

    sampled, rounds = _train_teacher_on(teacher, tokenizer, sft_data, heldout, sampled, settings=settings, seed=seed)
    best = (sampled, teacher, {"extra_rounds": rounds, "init": 0})
    for init in range(1, settings["teacher_max_inits"]):
        if best[0] >= settings["teacher_min_sampled"]:
            break
        other_seed = seed + 1000 * init
        teacher = build_model(tokenizer, hidden_size=settings["teacher_hidden"], seed=other_seed)
        sft(teacher, tokenizer, sft_data, steps=settings["teacher_steps"], lr=settings["lr"], seed=other_seed)
        sampled = task_accuracy(teacher, tokenizer, heldout, do_sample=True)
        sampled, rounds = _train_teacher_on(teacher, tokenizer, sft_data, heldout, sampled, settings=settings,
                                            seed=other_seed)
        if sampled > best[0]:
            best = (sampled, teacher, {"extra_rounds": rounds, "init": init})
    sampled, teacher, built = best
    return teacher, sampled, built


def make_tiny_task(directory: str | Path, *, overwrite: bool = False, **settings) -> Path:
    """Build `student/`, `teacher/`, `train.jsonl`, `heldout.jsonl` and `accuracy.json` under `directory` (cached:
    skipped if built there with the same settings; `settings` override `TASK_SETTINGS`)."""
    from trl_opd.tiny import build_model

    directory = Path(directory)
    settings = {**TASK_SETTINGS, **settings}
    done = directory / "DONE"
    if done.exists() and not overwrite and json.loads(done.read_text()) == settings:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_task_tokenizer()
    sft_data = addition_dataset(4096, seed=10)
    heldout = addition_rows(200, seed=2, heldout=True)
    accuracy = {}
    for name, seed in (("student", settings["seed"]), ("teacher", settings["seed"] + 1)):
        model = build_model(tokenizer, hidden_size=settings[f"{name}_hidden"], seed=seed)
        sft(model, tokenizer, sft_data, steps=settings[f"{name}_steps"], lr=settings["lr"], seed=seed)
        sampled, extra = task_accuracy(model, tokenizer, heldout, do_sample=True), {}
        if name == "teacher":
            model, sampled, extra = _build_teacher(model, tokenizer, sft_data, heldout, sampled, settings=settings,
                                                   seed=seed)
        model.save_pretrained(directory / name)
        tokenizer.save_pretrained(directory / name)
        accuracy[name] = {"greedy": task_accuracy(model, tokenizer, heldout), "sampled": sampled, **extra}
    _write_prompts(directory / "train.jsonl", addition_rows(2048, seed=1))
    _write_prompts(directory / "heldout.jsonl", heldout)
    (directory / "accuracy.json").write_text(json.dumps({"heldout_prompts": len(heldout), **accuracy}, indent=1))
    done.write_text(json.dumps(settings) + "\n")
    return directory


def make_other_family_teacher(directory: str | Path, *, overwrite: bool = False) -> Path:
    """A teacher of another model family for the task built in `directory`, in `directory / "teacher_other"`: its
    own tokenizer (numbers merge into multi-digit tokens where the student's are split one digit per token; other
    special tokens and chat template, `other_family_tokenizer`), trained as the task's teacher is, on the same rows.
    Cached; `accuracy.json` gets its accuracy as `teacher_other`."""
    from ..tiny import build_model, other_family_tokenizer

    directory = Path(directory)
    output = directory / "teacher_other"
    accuracy = json.loads((directory / "accuracy.json").read_text())
    if (output / "config.json").exists() and "teacher_other" in accuracy and not overwrite:
        return output
    settings = {**TASK_SETTINGS, **json.loads((directory / "DONE").read_text())}  # the task's own settings
    corpus = [row["prompt"][0]["content"] + " " + row["completion"][0]["content"] for row in addition_rows(2000, 0)]
    tokenizer = other_family_tokenizer(384, corpus=corpus)
    sft_data = addition_dataset(4096, seed=10)  # the rows the task's teacher was trained on
    heldout = [json.loads(line) for line in open(directory / "heldout.jsonl")]
    teacher = build_model(tokenizer, hidden_size=settings["teacher_hidden"], seed=settings["seed"] + 1)
    sft(teacher, tokenizer, sft_data, steps=settings["teacher_steps"], lr=settings["lr"], seed=settings["seed"] + 1)
    sampled = task_accuracy(teacher, tokenizer, heldout, do_sample=True)
    sampled, rounds = _train_teacher_on(teacher, tokenizer, sft_data, heldout, sampled, settings=settings,
                                        seed=settings["seed"] + 1)
    teacher.save_pretrained(output)
    tokenizer.save_pretrained(output)
    accuracy["teacher_other"] = {"greedy": task_accuracy(teacher, tokenizer, heldout), "sampled": sampled,
                                 "extra_rounds": rounds}
    (directory / "accuracy.json").write_text(json.dumps(accuracy, indent=1))
    return output


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trl-opd make-tiny-task", description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default="artifacts/tiny_task")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--seed", type=int, default=TASK_SETTINGS["seed"],
                        help="seed of the models' initialisation and training (the data stays the same)")
    args = parser.parse_args(argv)
    directory = make_tiny_task(args.directory, overwrite=args.overwrite, seed=args.seed)
    accuracy = json.loads((directory / "accuracy.json").read_text())
    print(f"{directory}: accuracy on {accuracy['heldout_prompts']} held-out prompts, greedy / sampled at temperature 1:"
          f" teacher {accuracy['teacher']['greedy']:.0%} / {accuracy['teacher']['sampled']:.0%},"
          f" student {accuracy['student']['greedy']:.0%} / {accuracy['student']['sampled']:.0%}")


if __name__ == "__main__":
    main()
