"""How exact a served teacher's `full` term is on real models: the teacher behind `trl-opd serve-teacher
--hidden-states` (vLLM's CPU build) with its head held here, against the same teacher loaded locally.

For each teacher, the same batch of real sequences (held-out code-task prompts in the student's chat template, each
followed by its answer) is scored both ways, every position after the first 8. Reported per position: the KL between
the two teachers' next-token distributions, KL(local || served), and the difference of the student's reverse KL to
each, |KL(student || served) - KL(student || local)|, which is what the `full` term trains on (largest and mean); and
the largest difference of the hidden states relative to their largest magnitude. The teacher is served in the dtype
it is stored in here (float32: the real models are built in float32), the same as the local one.

    OPD_MODELS_DIR=~/.cache/real-models .venv/bin/python benchmarks/served_hidden_exactness.py \
        --json benchmarks/results/served_hidden_exactness.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).parents[1]
PAIRS = (("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
         ("Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"))  # (teacher, student)


def batch_of(tokenizer, n: int, prompt_length: int = 8):
    """`n` held-out code-task conversations with their answers, split after `prompt_length` tokens (the rest scored)."""
    import torch

    from trl_opd.envs.code_output import code_rows

    texts = [tokenizer.apply_chat_template(row["prompt"] + [{"role": "assistant", "content": row["solution"]}],
                                           tokenize=False) for row in code_rows(n, seed=2)]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    width = max(len(sequence) for sequence in ids) - prompt_length
    prompts = torch.tensor([sequence[:prompt_length] for sequence in ids])
    completions = torch.zeros(n, width, dtype=torch.long)
    completion_mask = torch.zeros(n, width, dtype=torch.long)
    for row, sequence in enumerate(ids):
        rest = sequence[prompt_length:]
        completions[row, : len(rest)], completion_mask[row, : len(rest)] = torch.tensor(rest), 1
    return prompts, torch.ones_like(prompts), completions, completion_mask


def measure(teacher: str, student: str, *, n: int, python: str, log: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_opd.heads import OutputHead
    from trl_opd.models_dir import resolve_model
    from trl_opd.teachers import LocalTeacher
    from trl_opd.teachers.local import freeze_teacher
    from trl_opd.teachers.served_hidden import HiddenStateTeacher, load_teacher_head
    from trl_opd.tools.testing import TeacherServerProcess

    teacher_dir, student_dir = resolve_model(teacher), resolve_model(student)
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    batch = batch_of(tokenizer, n)
    mask = batch[3].bool()
    with TeacherServerProcess(teacher_dir, log, python, max_model_len=1024, extra=("--hidden-states",)) as server:
        served = HiddenStateTeacher(server.url, head=load_teacher_head(teacher_dir), return_hidden=True)
        served.connect(tokenizer, student_name=student)
        start = time.monotonic()
        served_hidden = served.score(*batch).hidden[mask]
        served_seconds = time.monotonic() - start
    local_model = freeze_teacher(AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32))
    local = LocalTeacher(local_model, batch_size=8, return_hidden=True)
    local_hidden = local.score(*batch).hidden[mask]
    head = OutputHead.of(local_model)
    student_model = freeze_teacher(AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32))
    with torch.no_grad():
        ids = torch.cat(batch[::2], dim=1)
        logits = student_model(ids, attention_mask=torch.cat(batch[1::2], dim=1)).logits[:, batch[0].size(1) - 1 : -1]
        student_logps = logits[mask].log_softmax(-1)
    teachers_kl, reverse_kl_diff = [], []
    for rows in torch.arange(len(local_hidden)).split(64):  # positions x vocabulary, a tile at a time
        local_logps = head.logits(local_hidden[rows]).log_softmax(-1)
        served_logps = head.logits(served_hidden[rows]).log_softmax(-1)
        teachers_kl.append((local_logps.exp() * (local_logps - served_logps)).sum(-1))
        s = student_logps[rows][:, : local_logps.size(-1)]
        p = s.exp()
        reverse_kl_diff.append(((p * (s - served_logps)).sum(-1) - (p * (s - local_logps)).sum(-1)).abs())
    teachers_kl, reverse_kl_diff = torch.cat(teachers_kl), torch.cat(reverse_kl_diff)
    hidden_error = ((served_hidden - local_hidden).abs().max() / local_hidden.abs().max()).item()
    return {"teacher": teacher, "student": student, "positions": int(mask.sum()), "served_dtype": "float32",
            "kl_local_served": {"max": teachers_kl.abs().max().item(), "mean": teachers_kl.abs().mean().item()},
            "reverse_kl_abs_difference": {"max": reverse_kl_diff.max().item(), "mean": reverse_kl_diff.mean().item()},
            "hidden_max_relative_error": hidden_error, "served_scoring_seconds": round(served_seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16, help="sequences per teacher")
    parser.add_argument("--json", required=True)
    parser.add_argument("--python", default=str(ROOT / ".venv-vllm" / "bin" / "python"), help="vLLM's interpreter")
    args = parser.parse_args()
    from trl_opd.tools.comparison import describe_machine

    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for teacher, student in PAIRS:
            results.append(measure(teacher, student, n=args.n, python=args.python, log=Path(scratch) / "vllm.log"))
            print(json.dumps(results[-1]), flush=True)
    Path(args.json).write_text(json.dumps({"machine": describe_machine(), "date": time.strftime("%Y-%m-%d"),
                                           "results": results}, indent=1))


if __name__ == "__main__":
    main()
