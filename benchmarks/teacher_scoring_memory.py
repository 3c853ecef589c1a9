"""Peak tensor memory and time of teacher scoring: `LocalTeacher` against the naive path.

Naive: full logits over every position, log_softmax, gather. `LocalTeacher`: the backbone, then the completion
positions only projected onto the vocabulary in tiles of about 2^23 logits. One-layer random models with large
vocabularies (Qwen2.5's 151,936 among them), since the LM head is where the memory goes. Prints a markdown table.

    .venv/bin/python benchmarks/teacher_scoring_memory.py
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def naive_scores(model, ids, mask, prompt_len):
    logits = model(input_ids=ids, attention_mask=mask).logits
    return logits[:, prompt_len - 1 : -1].log_softmax(-1).gather(-1, ids[:, prompt_len:, None])


def tiled_scores(teacher, ids, mask, prompt_len):
    return teacher.score(ids[:, :prompt_len], mask[:, :prompt_len], ids[:, prompt_len:], mask[:, prompt_len:])


def main() -> None:
    from functools import partial

    import torch

    from trl_opd.teachers import LocalTeacher
    from trl_opd.teachers.local import freeze_teacher
    from trl_opd.tiny import build_model, build_tokenizer
    from trl_opd.tools.testing import TensorMemoryMeter

    tokenizer = build_tokenizer()
    rows, prompt_len = 4, 16
    print("| vocab | tokens scored (B x T) | naive peak | LocalTeacher peak | ratio | naive time | LocalTeacher time |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for vocab_size in (32768, 151936, 262144):
        model = build_model(tokenizer, vocab_size=vocab_size, hidden_size=64, num_layers=1)
        teacher = LocalTeacher(freeze_teacher(model), batch_size=rows)
        for completion_len in (112, 496):
            ids = torch.randint(3, len(tokenizer), (rows, prompt_len + completion_len))
            mask = torch.ones_like(ids)
            measured = {}
            naive = partial(naive_scores, model, ids, mask, prompt_len)
            tiled = partial(tiled_scores, teacher, ids, mask, prompt_len)
            for name, fn in (("naive", naive), ("tiled", tiled)):
                with torch.no_grad():
                    fn()  # warm-up
                    with TensorMemoryMeter() as meter:
                        fn()
                    start = time.perf_counter()
                    fn()
                    measured[name] = (meter.peak / 2**20, time.perf_counter() - start)
            (naive_mib, naive_s), (tiled_mib, tiled_s) = measured["naive"], measured["tiled"]
            print(f"| {vocab_size} | {rows} x {completion_len} | {naive_mib:.0f} MiB | {tiled_mib:.0f} MiB | "
                  f"{naive_mib / tiled_mib:.1f}x | {naive_s:.2f} s | {tiled_s:.2f} s |")


if __name__ == "__main__":
    main()
