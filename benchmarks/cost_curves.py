"""Cost as the work grows: seconds and peak tensor memory of teacher scoring and of one student loss forward and
backward, for each estimator (`sampled`, `topk`, `full`) and for TRL's DistillationTrainer on the same batch in the
same run, against completion length, vocabulary and batch size.

    .venv/bin/python benchmarks/cost_curves.py --json benchmarks/results/cost_curves.json --plot docs/cost_curves.png

The models are small in width (2 Qwen3 layers, hidden 64; the teacher 96) and real in vocabulary: Llama 2's 32,000,
SmolLM2's 49,152, Qwen2.5's 151,936 and Gemma 3's 262,144 ids, since the vocabulary projection is where an
on-policy distillation step's memory goes. Completion ids are drawn uniformly over the vocabulary after a 16-token
prompt; every completion token is distilled. Three scans: completion length 256 to 8,192 tokens (Qwen2.5's
vocabulary, one sequence), vocabulary (1,024 tokens, one sequence), batch 1 to 8 sequences (1,024 tokens, Qwen2.5's
vocabulary).

Per point and arm: a first call under `TensorMemoryMeter` (the peak of tensor storage alive at once; it also warms
up), a timed call, and a call whose peak resident memory above what was resident before it is read from Linux's
counters (reset before the call; it also counts what kernels allocate outside tensors). Neither counts the weights;
both count gradients, activations and every temporary:
- `scoring <estimator>`: `LocalTeacher.score` as the trainer builds it for that estimator (the sampled tokens'
  log-probs; plus the top 20 ids and log-probs; or the final hidden states);
- `loss <estimator>`: `OPDTrainer.compute_loss` and its backward on the scored batch (the student's forward with the
  advantage formed in it, its dense term for `topk` / `full`), full fine-tuning;
- `TRL`: `DistillationTrainer.compute_loss` (reverse KL, `beta` 1) and its backward on the same batch, the teacher's
  forward included (it runs inside TRL's loss), skipped above `--trl-max-logits` logits per model (it holds several
  (batch, tokens, vocabulary) float32 tensors at once; the skip is printed).
Then the Python-side per-token work that no model does, at 8,192 tokens: the multi-turn action mask, and the
cross-tokenizer alignment and byte credit (`--cross` pair of tokenizers, the tiny pair's by default).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")

PROMPT = 16
QWEN = 151_936
VOCABULARIES = {"Llama 2": 32_000, "SmolLM2": 49_152, "Qwen2.5": QWEN, "Gemma 3": 262_144}
ESTIMATORS = ("sampled", "topk", "full")


def build_pair(directory: Path, vocab_size: int) -> dict[str, Path]:
    """A student (hidden 64) and teacher (hidden 96), 2 layers each, over `vocab_size` ids, saved with a tokenizer."""
    from trl_opd.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    paths = {}
    for name, hidden, seed in (("student", 64, 0), ("teacher", 96, 1)):
        path = directory / f"{name}-{vocab_size}"
        if not path.exists():
            build_model(tokenizer, hidden_size=hidden, vocab_size=vocab_size, seed=seed).save_pretrained(path)
            tokenizer.save_pretrained(path)
        paths[name] = path
    return paths


def _resident_mib() -> tuple[float, float]:
    """This process's resident memory now and its peak since the last reset, in MiB (Linux)."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            name, value = line.split(":")
            values[name] = int(value.split()[0]) / 1024
    return values["VmRSS"], values["VmHWM"]


def measure(call) -> dict:
    """Seconds of one call and two peaks of memory, in MiB: of tensor storage alive at once (`TensorMemoryMeter`, a
    first call, which also warms up), and of resident memory above what was resident before the call (a third call,
    after the peak counter is reset and freed memory handed back to the system; it also counts what kernels allocate
    outside tensors)."""
    from trl_opd.tools.testing import TensorMemoryMeter

    gc.collect()
    with TensorMemoryMeter() as meter:
        call()
    gc.collect()
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    before, _ = _resident_mib()
    call()
    _, peak = _resident_mib()
    return {"seconds": round(seconds, 4), "tensor_peak_mib": round(meter.peak / 2**20, 1),
            "resident_peak_mib": round(peak - before, 1)}


def batch(rows: int, tokens: int, vocab_size: int, seed: int = 0) -> dict:
    import torch

    generator = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, vocab_size, (rows, PROMPT), generator=generator)
    completion_ids = torch.randint(3, vocab_size, (rows, tokens), generator=generator)
    return {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
            "completion_mask": torch.ones_like(completion_ids), "advantages": torch.zeros(rows)}


def opd_trainer(pair: dict, estimator: str, rows: int, tokens: int, output_dir: Path):
    from datasets import Dataset

    from trl_opd import OPDConfig, OPDTrainer

    config = OPDConfig(output_dir=str(output_dir), per_device_train_batch_size=rows, num_generations=1,
                       max_completion_length=tokens, opd_estimator=estimator, report_to="none", save_strategy="no",
                       use_cpu=True, bf16=False, activation_checkpointing=False, disable_dropout=True)
    trainer = OPDTrainer(model=str(pair["student"]), teacher_model=str(pair["teacher"]), args=config,
                         train_dataset=Dataset.from_list([{"prompt": "1 + 1 ="}]))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def opd_arms(pair: dict, rows: int, tokens: int, vocab_size: int, output_dir: Path) -> dict:
    """Scoring and loss forward/backward for each estimator, on one batch."""
    results = {}
    for estimator in ESTIMATORS:
        results.update(estimator_arms(opd_trainer(pair, estimator, rows, tokens, output_dir), estimator,
                                      batch(rows, tokens, vocab_size)))
        gc.collect()
    return results


def estimator_arms(trainer, estimator: str, generated: dict) -> dict:
    from trl_opd.trainer.multiturn import action_mask

    args = (generated["prompt_ids"], generated["prompt_mask"], generated["completion_ids"],
            generated["completion_mask"])
    scores = {}
    results = {f"scoring {estimator}": measure(lambda: scores.update(out=trainer.teacher.score(*args)))}
    trainer._set_action_mask(generated, action_mask([{} for _ in generated["prompt_ids"]], generated["completion_mask"],
                                                    None))

    def loss_step():
        in_loss_forward = trainer.plan.advantages_in_loss_forward
        inputs = trainer._signal(dict(generated), scores["out"], in_loss_forward=in_loss_forward)
        trainer.compute_loss(trainer.model, inputs).backward()
        trainer.model.zero_grad(set_to_none=True)

    results[f"loss {estimator}"] = measure(loss_step)
    return results


def trl_arm(pair: dict, rows: int, tokens: int, vocab_size: int, output_dir: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DistillationConfig, DistillationTrainer

    config = DistillationConfig(output_dir=str(output_dir), per_device_train_batch_size=rows,
                                max_completion_length=tokens, beta=1.0, report_to="none", save_strategy="no",
                                use_cpu=True, bf16=False, activation_checkpointing=False)
    trainer = DistillationTrainer(
        model=AutoModelForCausalLM.from_pretrained(pair["student"], dtype=torch.float32),
        teacher_model=AutoModelForCausalLM.from_pretrained(pair["teacher"], dtype=torch.float32),
        args=config, train_dataset=Dataset.from_list([{"prompt": "1 + 1 ="}]))
    trainer.model.train()
    generated = batch(rows, tokens, vocab_size)
    inputs = {**generated, "num_items_in_batch": generated["completion_mask"].sum()}

    def loss_step():
        trainer.compute_loss(trainer.model, dict(inputs)).backward()
        trainer.model.zero_grad(set_to_none=True)

    return measure(loss_step)


def point(directory: Path, rows: int, tokens: int, vocab_size: int, trl_max_logits: int) -> dict:
    pair = build_pair(directory, vocab_size)
    arms = opd_arms(pair, rows, tokens, vocab_size, directory / "out")
    logits = rows * tokens * vocab_size
    arms["TRL"] = (trl_arm(pair, rows, tokens, vocab_size, directory / "out") if logits <= trl_max_logits
                   else {"skipped": f"{logits:,} logits per model > --trl-max-logits {trl_max_logits:,}"})
    return {"rows": rows, "tokens": tokens, "vocab": vocab_size, "arms": arms}


def python_per_token(tokens: int, cross: tuple[str, str] | None) -> dict:
    """Seconds per 1,000 tokens of the per-token work done in Python at `tokens` completion tokens."""
    import torch

    from trl_opd.trainer.multiturn import action_mask

    result = {}
    completion_mask = torch.ones(1, tokens, dtype=torch.long)
    rows = [{"action_mask": ([1] * 50 + [0] * 14) * (tokens // 64)}]
    start = time.perf_counter()
    action_mask(rows, completion_mask, None)
    result["action mask (rollout's, 1 row)"] = round((time.perf_counter() - start) / tokens * 1000, 6)
    if cross is not None:
        result.update(cross_tokenizer_per_token(tokens, *cross))
    return result


def cross_tokenizer_per_token(tokens: int, student_path: str, teacher_path: str) -> dict:
    """The cross-tokenizer teacher's Python work for one completion of `tokens` student tokens (reading the text in
    the teacher's tokens, aligning the chunks, the credit), around a teacher that answers like a served one (its top
    20 at each position) without a model, so that no model's time is counted."""
    import torch
    from transformers import AutoTokenizer

    from trl_opd.teachers.base import TeacherScores
    from trl_opd.teachers.cross import CrossTokenizerTeacher

    student = AutoTokenizer.from_pretrained(student_path)
    teacher = AutoTokenizer.from_pretrained(teacher_path)
    text = " ".join(f"{a} + {b} = {a + b}." for a in range(1000) for b in range(3))
    completion = torch.tensor([student(text, add_special_tokens=False)["input_ids"][:tokens]])
    ones = torch.ones_like(completion)

    class ServedLike:  # a served teacher's answer (log-probs and top entries), without its model
        topk = 0

        def score(self, prompt_ids, prompt_mask, completion_ids, completion_mask, **kwargs):
            shape = completion_ids.shape
            top = torch.arange(20).expand(*shape, 20)
            return TeacherScores(logps=torch.full(shape, -1.0), topk_ids=top, topk_logps=torch.full((*shape, 20), -3.0))

    result = {}
    for credit in ("byte", "chunk"):
        scorer = CrossTokenizerTeacher(ServedLike(), student_tokenizer=student, teacher_tokenizer=teacher,
                                       stop_ids=[student.eos_token_id], credit=credit)
        start = time.perf_counter()
        scorer.score([[{"role": "user", "content": "1 + 1 ="}]], completion, ones, ones)
        seconds = time.perf_counter() - start
        result[f"cross-tokenizer {credit} credit (alignment and credit, 1 row)"] = round(
            seconds / completion.size(1) * 1000, 6)
    return result


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scans = (("tokens", "completion tokens (Qwen2.5 vocabulary, 1 sequence)"),
             ("vocab", "vocabulary (1,024 tokens, 1 sequence)"), ("rows", "sequences (1,024 tokens, Qwen2.5)"))
    figure, axes = plt.subplots(2, 3, figsize=(15, 8))
    for column, (scan, label) in enumerate(scans):
        points = results["scans"][scan]
        xs = [entry[scan] for entry in points]
        for arm in [*(f"loss {e}" for e in ESTIMATORS), *(f"scoring {e}" for e in ESTIMATORS), "TRL"]:
            measured = [(x, entry["arms"][arm]) for x, entry in zip(xs, points, strict=True)
                        if "seconds" in entry["arms"][arm]]
            style = "-" if arm.startswith("loss") else ":" if arm.startswith("scoring") else "--"
            for row, key in enumerate(("seconds", "tensor_peak_mib")):
                axes[row][column].plot([x for x, _ in measured], [m[key] for _, m in measured], style, marker="o",
                                       label=arm)
        for row, key in enumerate(("seconds", "peak tensor memory (MiB)")):
            axes[row][column].set_xlabel(label)
            axes[row][column].set_ylabel(key)
            axes[row][column].set_xscale("log", base=2)
            axes[row][column].set_yscale("log")
    axes[0][0].legend(fontsize=7)
    figure.suptitle("OPD step costs against TRL's DistillationTrainer (TRL: loss with the teacher's forward inside)")
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def main() -> None:
    from trl_opd.tools.comparison import describe_machine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 2048, 4096, 8192])
    parser.add_argument("--vocabularies", type=int, nargs="+", default=list(VOCABULARIES.values()))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--trl-max-logits", type=int, default=2**30)
    parser.add_argument("--cross", nargs=2, metavar=("STUDENT_TOKENIZER", "TEACHER_TOKENIZER"),
                        help="the cross-tokenizer scan's pair (default: the tiny pair, built here)")
    parser.add_argument("--json", default="benchmarks/results/cost_curves.json")
    parser.add_argument("--plot", default="docs/cost_curves.png")
    args = parser.parse_args()

    import torch

    torch.manual_seed(0)
    results = {"machine": describe_machine(), "date": time.strftime("%Y-%m-%d"), "scans": {}}
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        scans = {"tokens": [(1, t, QWEN) for t in args.tokens], "vocab": [(1, 1024, v) for v in args.vocabularies],
                 "rows": [(r, 1024, QWEN) for r in args.rows]}
        measured_points = {}  # a point two scans share is measured once
        for scan, points in scans.items():
            results["scans"][scan] = []
            for shape in points:
                if shape not in measured_points:
                    measured_points[shape] = point(directory, *shape, args.trl_max_logits)
                measured = measured_points[shape]
                results["scans"][scan].append(measured)
                print(json.dumps(measured), flush=True)
                Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
        cross = args.cross
        if cross is None:
            from trl_opd.tiny import make_tiny, make_tiny_other_teacher

            tiny, other = make_tiny(directory / "tiny"), make_tiny_other_teacher(directory / "other")
            cross = (str(tiny / "student"), str(other))
        results["python_seconds_per_1k_tokens_at_8k"] = python_per_token(8192, cross)
        print(json.dumps(results["python_seconds_per_1k_tokens_at_8k"]), flush=True)
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    plot(results, Path(args.plot))
    print_tables(results)


def print_tables(results: dict) -> None:
    print(f"\n{results['machine']}, {results['date']}")
    arms = [*(f"scoring {e}" for e in ESTIMATORS), *(f"loss {e}" for e in ESTIMATORS), "TRL"]
    print("| scan | B | T | V | " + " | ".join(arms) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(arms))
    for scan, points in results["scans"].items():
        for entry in points:
            cells = []
            for arm in arms:
                m = entry["arms"][arm]
                cells.append("skipped" if "skipped" in m else
                             f"{m['seconds']:.2f} s, {m['tensor_peak_mib']:.0f} / {m['resident_peak_mib']:.0f} MiB")
            print(f"| {scan} | {entry['rows']} | {entry['tokens']} | {entry['vocab']} | " + " | ".join(cells) + " |")
    for name, value in results.get("python_seconds_per_1k_tokens_at_8k", {}).items():
        print(f"{name}: {value * 1000:.2f} ms per 1k tokens at 8k tokens")


if __name__ == "__main__":
    main()
