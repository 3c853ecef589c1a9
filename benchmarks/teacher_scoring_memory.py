"""Peak tensor memory and time of teacher scoring: the fused head (what LocalTeacher uses) against the naive path.

Naive: full logits, log_softmax, gather. Fused: TRL's fused LM head in (tokens, vocab) tiles. One-layer random
models with large vocabularies, since the LM head is where the memory goes. Prints a markdown table for the README.

    .venv/bin/python benchmarks/teacher_scoring_memory.py
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def naive_scores(model, ids, mask, prompt_len):
    logits = model(input_ids=ids, attention_mask=mask).logits
    return logits[:, prompt_len - 1 : -1].log_softmax(-1).gather(-1, ids[:, prompt_len:, None])


def fused_scores(teacher, ids, mask, prompt_len):
    return teacher.score(ids[:, :prompt_len], mask[:, :prompt_len], ids[:, prompt_len:], mask[:, prompt_len:])


def main() -> None:
    from functools import partial

    import torch

    from trl_opd.teachers import LocalTeacher
    from trl_opd.teachers.local import freeze_teacher
    from trl_opd.testing import TensorMemoryMeter, build_model, build_tokenizer

    tokenizer = build_tokenizer()
    rows, prompt_len = 4, 16
    print("| vocab | tokens scored (B x T) | naive peak | fused peak | ratio | naive time | fused time |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for vocab_size in (32768, 131072, 262144):
        model = build_model(tokenizer, vocab_size=vocab_size, hidden_size=64, num_layers=1)
        teacher = LocalTeacher(freeze_teacher(model), batch_size=rows)
        for completion_len in (112, 496):
            ids = torch.randint(3, len(tokenizer), (rows, prompt_len + completion_len))
            mask = torch.ones_like(ids)
            measured = {}
            naive = partial(naive_scores, model, ids, mask, prompt_len)
            fused = partial(fused_scores, teacher, ids, mask, prompt_len)
            for name, fn in (("naive", naive), ("fused", fused)):
                with torch.no_grad():
                    fn()  # warm-up
                    with TensorMemoryMeter() as meter:
                        fn()
                    start = time.perf_counter()
                    fn()
                    measured[name] = (meter.peak / 2**20, time.perf_counter() - start)
            (naive_mib, naive_s), (fused_mib, fused_s) = measured["naive"], measured["fused"]
            print(f"| {vocab_size} | {rows} x {completion_len} | {naive_mib:.0f} MiB | {fused_mib:.0f} MiB | "
                  f"{naive_mib / fused_mib:.1f}x | {naive_s:.2f} s | {fused_s:.2f} s |")


if __name__ == "__main__":
    main()
