"""`trl-opd serve-teacher MODEL [vllm args]`: start a vLLM server set up for teacher scoring, and say how to use it.

Teacher scoring needs raw log-probs of given tokens (`prompt_logprobs`), enough `--max-logprobs` for top-k scoring,
and no prefix caching (prompt log-prob requests do not use it reliably). The server also gets this project's compact
scoring endpoint (`/opd/score`, `trl_opd/server_route`), which the trainer uses where a server has it; the stock
OpenAI endpoints stay as they are. Extra arguments go to vLLM unchanged and win over these defaults.

Memory: vLLM sizes its KV cache from a profile that does not include prompt log-probs, yet scoring a prefill chunk
of N tokens materialises N x vocabulary float32 logits and their log-softmax (2 x 4 bytes each: 2.5 GB for 2,048
tokens of a 152k vocabulary). So the server prefills at most `--max-num-batched-tokens` (default 2048) tokens at a
time and takes `--gpu-memory-utilization` 0.8 of the GPU (vLLM's own default is 0.9), which leaves room for that.

Hidden states (`--hidden-states`): vLLM serves the teacher as a pooling model that returns the final hidden states
at the scored positions (`/opd/hidden`), and the trainer projects them through the teacher's head, held locally
(`teachers/served_hidden.py`): exact logits, so the `full` estimator, for hidden size x 2 bytes per token in bf16
instead of a vocabulary of float32 log-probs. Such a server gives no log-probs itself and cannot generate.

Address: the server listens on 127.0.0.1 unless told otherwise. For a trainer on another node, pass `--host 0.0.0.0`
(or this node's address) and put this node's address in `teacher_server_url`; use `--api-key` on a shared network.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
from pathlib import Path

# The compact scoring endpoint, imported by the server from ROUTE_DIR (which holds that one module only)
ROUTE_DIR = Path(__file__).parents[1] / "server_route"
SCORING_ROUTE = "opd_scoring_route.opd_scoring"
# The prefill chunk (tokens) and GPU share set for scoring, see the module docstring
SCORING_BATCHED_TOKENS = 2048
SCORING_GPU_MEMORY_UTILIZATION = 0.8
# The causal LM as a pooling model that returns every position's final hidden state (after the final norm, the
# head's input) as it is: token embedding, all positions, no normalisation. No prefix caching: a cached position
# would not be pooled.
HIDDEN_STATE_FLAGS = ("--runner", "pooling", "--convert", "embed",
                      "--pooler-config", '{"tok_pooling_type": "ALL", "use_activation": false}')


def server_env(environ: dict) -> dict:
    """The server's environment: `environ` with ROUTE_DIR first on its PYTHONPATH."""
    paths = [str(ROUTE_DIR), *filter(None, environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**environ, "PYTHONPATH": os.pathsep.join(paths)}


def vllm_command(model: str, *, python: str, host: str, port: int, max_logprobs: int, extra: list[str],
                 max_num_batched_tokens: int = SCORING_BATCHED_TOKENS,
                 gpu_memory_utilization: float = SCORING_GPU_MEMORY_UTILIZATION,
                 hidden_states: bool = False) -> list[str]:
    """The server command line: vLLM's OpenAI-compatible API server with the flags teacher scoring needs. With
    `hidden_states`, a pooling server that returns the final hidden states instead (`HIDDEN_STATE_FLAGS`)."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host, "--port",
               str(port), "--max-logprobs", str(max_logprobs), "--no-enable-prefix-caching",
               "--logprobs-mode", "raw_logprobs", "--middleware", SCORING_ROUTE,
               "--max-num-batched-tokens", str(max_num_batched_tokens),
               "--gpu-memory-utilization", str(gpu_memory_utilization), *(HIDDEN_STATE_FLAGS if hidden_states else ())]
    given = {arg.split("=")[0] for arg in extra if arg.startswith("--")}
    for flag in ("--host", "--port", "--max-logprobs", "--logprobs-mode", "--max-num-batched-tokens",
                 "--gpu-memory-utilization"):
        if flag in given:  # the user's value wins: drop ours and its value
            at = command.index(flag)
            del command[at : at + 2]
    if "--enable-prefix-caching" in given:
        command.remove("--no-enable-prefix-caching")
    return command + extra


def has_vllm(python: str) -> bool:
    """Whether `python` can find the vllm package (without importing it: that takes seconds)."""
    import subprocess

    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# The oldest vLLM `--hidden-states` is tested with (its token-embedding pooler of every position, unnormalised)
HIDDEN_STATES_MIN_VLLM = (0, 31)


def vllm_version(python: str) -> tuple[int, ...] | None:
    """The (major, minor) of the vllm that `python` finds, read from its `_version.py` without importing it."""
    import subprocess

    probe = ("import importlib.util, pathlib, re; spec = importlib.util.find_spec('vllm'); "
             "text = (pathlib.Path(spec.origin).parent / '_version.py').read_text(); "
             "print(re.search(r\"version = '([0-9]+)\\.([0-9]+)\", text).group(0))")
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"([0-9]+)\.([0-9]+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trl-opd serve-teacher", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="path or Hub id of the teacher")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on; 0.0.0.0 for trainers on other nodes (default: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-logprobs", type=int, default=20, help="the largest top-k the trainer may ask for")
    parser.add_argument("--max-num-batched-tokens", type=int, default=SCORING_BATCHED_TOKENS,
                        help="tokens prefilled at a time: each needs a vocabulary of float32 logits for its log-probs, "
                             "outside vLLM's memory profile")
    parser.add_argument("--gpu-memory-utilization", type=float, default=SCORING_GPU_MEMORY_UTILIZATION,
                        help="share of the GPU vLLM takes (weights and KV cache), leaving the rest for the log-probs")
    parser.add_argument("--hidden-states", action="store_true",
                        help="return the teacher's final hidden states instead of log-probs (vLLM 0.31+): the trainer "
                             "projects them through the teacher's head, held locally, for the exact 'full' estimator "
                             "at a fraction of the logits' bytes")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter with vllm installed (vllm often lives in its own virtualenv)")
    parser.add_argument("--dry-run", action="store_true", help="print the command and exit")
    args, extra = parser.parse_known_args(argv)
    if not args.dry_run and not has_vllm(args.python):
        raise SystemExit(
            f"{args.python} cannot import vllm, so it cannot serve the teacher. Install it there first "
            "(`pip install 'trl_opd[vllm]'`, or vllm in a virtualenv of its own, then pass that interpreter with "
            "--python), and start again."
        )
    version = vllm_version(args.python) if args.hidden_states and not args.dry_run else None
    if version is not None and version < HIDDEN_STATES_MIN_VLLM:
        raise SystemExit(
            f"--hidden-states needs vLLM {'.'.join(map(str, HIDDEN_STATES_MIN_VLLM))} or later (its pooling runner "
            f"returning every position's final hidden state); {args.python} has vLLM {'.'.join(map(str, version))}. "
            "Upgrade vLLM there, or serve log-probs (without --hidden-states) and use opd_estimator: topk."
        )
    route = ROUTE_DIR / f"{SCORING_ROUTE.split('.')[0]}.py"
    if not route.is_file():
        raise SystemExit(
            f"This installation of trl_opd lacks its scoring endpoint ({route}), so the server would answer only "
            "vLLM's slow stock endpoint. Reinstall trl_opd (`pip install --force-reinstall trl_opd`) and start again."
        )
    command = vllm_command(args.model, python=args.python, host=args.host, port=args.port,
                           max_logprobs=args.max_logprobs, extra=extra,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           gpu_memory_utilization=args.gpu_memory_utilization, hidden_states=args.hidden_states)
    everywhere = args.host in ("0.0.0.0", "::")
    host = socket.gethostname() if everywhere else args.host
    print(" ".join(command))
    print(f"Compact scoring endpoint {'/opd/hidden' if args.hidden_states else '/opd/score'} from {route}")
    print(f"Teacher will serve at http://{host}:{args.port} once /health answers "
          f"({'from other nodes too' if everywhere else 'from this machine only; --host 0.0.0.0 for other nodes'})."
          f" In a recipe:\n  teacher_server_url: http://{host}:{args.port}", flush=True)
    if not args.dry_run:
        os.execve(command[0], command, server_env(dict(os.environ)))
