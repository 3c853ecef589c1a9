"""The served teacher on a real model: vLLM's CPU build serving Qwen2.5-Coder-1.5B-Instruct scores the real student's
rollouts, against the same checkpoint as a local teacher in this process.

    make real-models && .venv/bin/trl-opd make-code-task artifacts/code_task
    export OPD_MODELS_DIR=~/.cache/real-models      # offline: where `make real-models` put the Hub's models
    .venv/bin/python benchmarks/served_real_teacher.py      # about 5 minutes on 2 cores, 10 GB of memory

The 0.5B student samples completions to held-out prompts of the code task (temperature 1, the rollouts OPD trains
on); both teachers score exactly those token ids. Prints the largest and the mean absolute difference of the
per-token log-probs, whether the two agree on the teacher's argmax at each token, and the top-k log-probs' difference.
Both models are Hub ids (`--student`, `--teacher`), read from their copies in OPD_MODELS_DIR where it is set.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_opd.evaluation import stop_token_ids, until_first_stop
from trl_opd.models_dir import resolve_model
from trl_opd.teachers import LocalTeacher
from trl_opd.teachers.local import freeze_teacher
from trl_opd.teachers.vllm_server import VLLMServerTeacher
from trl_opd.tools.comparison import describe_machine
from trl_opd.tools.testing import TeacherServerProcess

ROOT = Path(__file__).parents[1]


@torch.no_grad()
def rollouts(student_dir: str, prompts: list, *, max_new_tokens: int, seed: int = 0):
    """The student's sampled completions as (prompt_ids, prompt_mask, completion_ids, completion_mask)."""
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32).eval()
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    stop = stop_token_ids(student, tokenizer)
    torch.manual_seed(seed)
    out = student.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           max_new_tokens=max_new_tokens, eos_token_id=stop, pad_token_id=tokenizer.pad_token_id)
    completion = out[:, batch["input_ids"].size(1) :]
    completion_mask = until_first_stop(completion, stop).long()
    return tokenizer, (batch["input_ids"], batch["attention_mask"], completion, completion_mask)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_help = "a Hub id (read from its copy in OPD_MODELS_DIR where set) or a directory; default: %(default)s"
    parser.add_argument("--student", default="Qwen/Qwen2.5-Coder-0.5B-Instruct", help=model_help)
    parser.add_argument("--teacher", default="Qwen/Qwen2.5-Coder-1.5B-Instruct", help=model_help)
    parser.add_argument("--heldout", default="artifacts/code_task/heldout.jsonl")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--topk", type=int, default=20)
    parser.add_argument("--vllm-python", default=os.environ.get("OPD_VLLM_PYTHON", str(ROOT / ".venv-vllm/bin/python")))
    parser.add_argument("--json", default="benchmarks/results/served_real_teacher.json")
    args = parser.parse_args(argv)
    student, teacher_dir = resolve_model(args.student), resolve_model(args.teacher)  # the JSON keeps the names

    server = TeacherServerProcess(Path(teacher_dir).resolve(), Path("/tmp/served_real_teacher.log"), args.vllm_python)
    server.start()  # boots (a minute or two) while the student samples
    try:
        rows = [json.loads(line) for line in open(args.heldout)][: args.prompts]
        tokenizer, batch = rollouts(student, [row["prompt"] for row in rows], max_new_tokens=args.max_new_tokens)
        server.wait_ready()
        served = VLLMServerTeacher([server.url], batch_size=16, topk=args.topk)
        served.connect(tokenizer, student_name=args.student)
        start = time.perf_counter()
        served_scores = served.score(*batch)
        served_seconds = time.perf_counter() - start
    finally:
        server.stop()
    teacher = freeze_teacher(AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32))
    local = LocalTeacher(teacher, batch_size=16, topk=args.topk, student_vocab_size=len(tokenizer))
    start = time.perf_counter()
    local_scores = local.score(*batch)
    local_seconds = time.perf_counter() - start

    mask = batch[3].bool()
    difference = (served_scores.logps[mask] - local_scores.logps[mask]).abs()
    topk_difference = (served_scores.topk_logps[mask] - local_scores.topk_logps[mask]).abs()
    result = {
        "machine": describe_machine(), "date": time.strftime("%Y-%m-%d"), "student": args.student,
        "teacher": args.teacher, "sequences": int(mask.size(0)), "tokens": int(mask.sum()),
        "logp_max_abs_diff": difference.max().item(), "logp_mean_abs_diff": difference.mean().item(),
        "argmax_agreement": (served_scores.is_top1[mask] == local_scores.is_top1[mask]).float().mean().item(),
        "topk_ids_equal": (served_scores.topk_ids[mask] == local_scores.topk_ids[mask]).float().mean().item(),
        "topk_logp_max_abs_diff": topk_difference.max().item(), "served_seconds": served_seconds,
        "local_seconds": local_seconds,
    }
    print(json.dumps(result, indent=1))
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
