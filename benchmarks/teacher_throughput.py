"""Scoring throughput of the served teacher (vLLM CPU server over HTTP) against the local teacher, same model, and
where the served time goes.

Scores the same batches of student-shaped sequences (16 sequences, a 20-token prompt, completions of each length)
both ways, for each number k of top entries asked per position (0: the sampled token only; 5 and 20: the topk
estimator, a cross-tokenizer teacher's byte credit), and reports completion tokens scored per second and their ratio.
Then, for the served teacher, one batch's time split into its stages, each timed on its own (medians of the repeats):

- build: the request's JSON body, on the client;
- server, no log-probs: the same request without `prompt_logprobs` (the server's model compute over every token,
  plus its HTTP handling; one output token);
- server, log-probs: the request as the scorer sends it, until its whole answer is read (so: the above, plus the
  server's log-prob work, its JSON encoding and the transfer);
- decode: the answer's JSON into Python objects, on the client;
- read: the scorer's reading of those objects into tensors, with its checks;
- /opd/score, 2 tokens: the compact endpoint on as many sequences of 2 tokens each, the fixed cost of a request of
  that many sequences (HTTP, one engine request per sequence, the engine's steps) with almost no model compute.

Starts its own server through `trl-opd serve-teacher` with vLLM's interpreter (`make test` builds `.venv-vllm`).
The teacher is the tiny one of the test suite unless `--teacher` names a model (a directory, or a Hub id read from its
copy in OPD_MODELS_DIR): with a real model the model's own compute is most of the time, with the tiny one the fixed
cost of a request is.

    .venv/bin/python benchmarks/teacher_throughput.py [--lengths 24 256 1024] [--topk 0 5 20] [--json PATH]
    .venv/bin/python benchmarks/teacher_throughput.py --teacher DIR --lengths 256 --topk 0 20 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from trl_opd.models_dir import resolve_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT_TOKENS = 20


def timed(function, repeats: int) -> float:
    """The median seconds of `repeats` calls, after one warm-up call."""
    function()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def served_stages(teacher, batch, repeats: int) -> dict[str, float]:
    """Median seconds of each stage of scoring `batch` in one request (see the module's docstring), through the
    stock `/v1/completions` and through the compact `/opd/score`."""
    from trl_opd.teachers.completions_response import completion_payload, read_entries

    prompt_ids, _, completion_ids, _ = batch
    prompts, completions = prompt_ids.tolist(), completion_ids.tolist()
    sequences = [p + c for p, c in zip(prompts, completions, strict=True)]
    url = teacher.urls[0]
    model = teacher.models.get(url, "")
    payload = completion_payload(model, sequences, topk=teacher.topk)
    body = json.dumps(payload).encode()
    bare = json.dumps({**payload, "prompt_logprobs": None}).encode()
    compact = json.dumps({"sequences": sequences, "score_from": [len(p) for p in prompts],
                          "topk": teacher.topk}).encode()
    headers = {"Content-Type": "application/json"}

    def post(path: str, data: bytes) -> bytes:
        response = teacher._session.post(url + path, data=data, headers=headers, timeout=teacher.timeout)
        response.raise_for_status()
        return response.content

    content = post("/v1/completions", body)
    answer = json.loads(content)
    entries = [choice["prompt_logprobs"] for choice in sorted(answer["choices"], key=lambda c: c["index"])]

    def read() -> None:
        for i, sequence_entries in enumerate(entries):
            read_entries(sequence_entries, prompts[i], completions[i], index=i, url=url, topk=teacher.topk)

    compact_content = post("/opd/score", compact)
    floor = json.dumps({"sequences": [sequence[:2] for sequence in sequences], "score_from": [1] * len(sequences),
                        "topk": teacher.topk}).encode()
    return {
        "compact_floor": timed(lambda: post("/opd/score", floor), repeats),
        "build": timed(lambda: json.dumps(completion_payload(model, sequences, topk=teacher.topk)).encode(), repeats),
        "server_bare": timed(lambda: post("/v1/completions", bare), repeats),
        "server": timed(lambda: post("/v1/completions", body), repeats),
        "decode": timed(lambda: json.loads(content), repeats),
        "read": timed(read, repeats),
        "answer_mb": len(content) / 1e6,
        "compact_server": timed(lambda: post("/opd/score", compact), repeats),
        "compact_answer_mb": len(compact_content) / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", default="artifacts/tiny")
    parser.add_argument("--teacher", type=lambda name: Path(resolve_model(name)),
                        help="a model directory or mirrored Hub id (OPD_MODELS_DIR) to serve and score with, instead "
                        "of the tiny teacher (e.g. HuggingFaceTB/SmolLM2-135M-Instruct after `make real-models`)")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument("--lengths", type=int, nargs="+", default=[24, 256, 1024])
    parser.add_argument("--topk", type=int, nargs="+", default=[0, 5, 20])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", type=Path, help="also write the measurements here")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_opd.teachers import LocalTeacher
    from trl_opd.teachers.local import freeze_teacher
    from trl_opd.teachers.vllm_server import VLLMServerTeacher
    from trl_opd.tiny import make_tiny
    from trl_opd.tools.comparison import describe_machine
    from trl_opd.tools.testing import TeacherServerProcess

    torch.set_num_threads(os.cpu_count())
    teacher_dir = args.teacher or make_tiny(args.tiny) / "teacher"
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    model = freeze_teacher(AutoModelForCausalLM.from_pretrained(teacher_dir))
    config = model.config
    described = (f"{teacher_dir.name} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
                 f"{config.vocab_size:,}-token vocabulary)")
    g = torch.Generator().manual_seed(0)
    batches = {}
    for length in args.lengths:
        prompt_ids = torch.randint(3, len(tokenizer), (args.rows, PROMPT_TOKENS), generator=g)
        completion_ids = torch.randint(3, len(tokenizer), (args.rows, length), generator=g)
        batches[length] = (prompt_ids, torch.ones_like(prompt_ids), completion_ids, torch.ones_like(completion_ids))

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        log, python = f"{scratch}/server.log", os.path.abspath(args.vllm_python)
        # the tiny teacher was built for 512 positions: a copy that allows the longest sequence (its rotary positions
        # go on; what it says past 512 does not matter to a throughput measurement)
        max_model_len = PROMPT_TOKENS + max(args.lengths) + 1
        served_dir = teacher_dir
        if model.config.max_position_embeddings < max_model_len:
            model.config.max_position_embeddings = max_model_len
            served_dir = f"{scratch}/teacher"
            model.save_pretrained(served_dir)
            tokenizer.save_pretrained(served_dir)
        with TeacherServerProcess(served_dir, log, python, max_model_len=max_model_len) as server:
            for k in args.topk:
                local = LocalTeacher(model, batch_size=args.rows, topk=k)
                served = VLLMServerTeacher(server.url, batch_size=args.rows, topk=k)
                served.connect(tokenizer, student_name="the teacher's own tokenizer")
                for length, batch in batches.items():
                    tokens = args.rows * length
                    local_seconds = timed(lambda: local.score(*batch), args.repeats)  # noqa: B023
                    served.compact[server.url] = False  # the stock endpoint, as any vLLM server has it
                    stock_seconds = timed(lambda: served.score(*batch), args.repeats)  # noqa: B023
                    served.compact[server.url] = True  # `trl-opd serve-teacher`'s /opd/score, which the scorer uses
                    served_seconds = timed(lambda: served.score(*batch), args.repeats)  # noqa: B023
                    rows.append({"length": length, "topk": k, "local_tok_s": tokens / local_seconds,
                                 "stock_tok_s": tokens / stock_seconds, "stock_seconds": stock_seconds,
                                 "served_tok_s": tokens / served_seconds, "served_seconds": served_seconds,
                                 **served_stages(served, batch, args.repeats)})
                    print(rows[-1], flush=True)

    machine, date = describe_machine(), time.strftime("%Y-%m-%d")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "date": date, "teacher": described, "rows": args.rows,
                                         "repeats": args.repeats, "prompt_tokens": PROMPT_TOKENS, "results": rows},
                                        indent=1) + "\n")
    print(f"\nCompletion tokens scored per second, teacher {described}, {args.rows} sequences with a "
          f"{PROMPT_TOKENS}-token prompt; {machine}, {date}; medians of {args.repeats} repeats; server and scorer "
          "share the machine\n")
    print("| completion tokens | top-k entries | local teacher | server, stock /v1/completions | server, /opd/score | "
          "stock / local | /opd/score / local |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['length']} | {row['topk']} | {row['local_tok_s']:,.0f} tok/s | {row['stock_tok_s']:,.0f} tok/s "
              f"| {row['served_tok_s']:,.0f} tok/s | {row['stock_tok_s'] / row['local_tok_s']:.2f}x "
              f"| {row['served_tok_s'] / row['local_tok_s']:.2f}x |")
    print("\nWhere one served batch's time goes, milliseconds (medians; each stage timed on its own)\n")
    print("| completion tokens | top-k | server, no log-probs | stock: server | decode | read | answer MB | "
          "scored in | /opd/score: 2 tokens | server | answer MB | scored in |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        ms = {name: 1e3 * row[name] for name in ("server_bare", "server", "decode", "read", "stock_seconds",
                                                 "compact_floor", "compact_server", "served_seconds")}
        print(f"| {row['length']} | {row['topk']} | {ms['server_bare']:.1f} | {ms['server']:.1f} | {ms['decode']:.1f} "
              f"| {ms['read']:.1f} | {row['answer_mb']:.2f} | {ms['stock_seconds']:.1f} | {ms['compact_floor']:.1f} "
              f"| {ms['compact_server']:.1f} "
              f"| {row['compact_answer_mb']:.2f} | {ms['served_seconds']:.1f} |")


if __name__ == "__main__":
    main()
