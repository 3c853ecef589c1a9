"""Scoring throughput of the served teacher (vLLM CPU server over HTTP) against the local teacher, same model.

Scores the same batches of student-shaped sequences both ways and reports completion tokens scored per second and
their ratio. Starts its own server through `trl-opd serve-teacher` with vLLM's interpreter (`make test` builds
`.venv-vllm`). Prints a markdown table for the README.

    .venv/bin/python benchmarks/teacher_throughput.py [--vllm-python .venv-vllm/bin/python]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tokens_per_second(teacher, batch, repeats: int) -> float:
    teacher.score(*batch)  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        teacher.score(*batch)
    return repeats * int(batch[3].sum()) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", default="artifacts/tiny")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_opd.teachers import LocalTeacher
    from trl_opd.teachers.local import freeze_teacher
    from trl_opd.teachers.vllm_server import VLLMServerTeacher
    from trl_opd.testing import TeacherServerProcess, make_tiny

    torch.set_num_threads(os.cpu_count())
    tiny = make_tiny(args.tiny)
    tokenizer = AutoTokenizer.from_pretrained(tiny / "student")
    local = LocalTeacher(freeze_teacher(AutoModelForCausalLM.from_pretrained(tiny / "teacher")), batch_size=16)
    shapes = [(16, 24), (16, 256)]  # (sequences, completion tokens) after a 20-token prompt
    g = torch.Generator().manual_seed(0)
    batches = []
    for rows, length in shapes:
        prompt_ids = torch.randint(3, len(tokenizer), (rows, 20), generator=g)
        completion_ids = torch.randint(3, len(tokenizer), (rows, length), generator=g)
        batches.append((prompt_ids, torch.ones_like(prompt_ids), completion_ids, torch.ones_like(completion_ids)))

    with tempfile.TemporaryDirectory() as scratch:
        log, python = f"{scratch}/server.log", os.path.abspath(args.vllm_python)
        with TeacherServerProcess(tiny / "teacher", log, python) as server:
            served = VLLMServerTeacher(server.url, batch_size=16)
            served.connect(tokenizer, student_name="tiny student")
            results = [(tokens_per_second(local, b, args.repeats), tokens_per_second(served, b, args.repeats))
                       for b in batches]

    print(f"\nCompletion tokens scored per second, tiny teacher (hidden 96, 2 layers), {os.cpu_count()} CPU cores, "
          f"{time.strftime('%Y-%m-%d')}, {args.repeats} repeats; server and scorer share the machine\n")
    print("| batch (sequences x completion tokens) | local teacher | vLLM server (HTTP) | server / local |")
    print("|---|---:|---:|---:|")
    for (rows, length), (local_tps, served_tps) in zip(shapes, results, strict=True):
        ratio = served_tps / local_tps
        print(f"| {rows} x {length} | {local_tps:,.0f} tok/s | {served_tps:,.0f} tok/s | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
