"""`trl-opd serve-teacher MODEL [vllm args]`: start a vLLM server set up for teacher scoring, and say how to use it.

Teacher scoring needs raw log-probs of given tokens (`prompt_logprobs`), enough `--max-logprobs` for top-k scoring,
and no prefix caching (prompt log-prob requests do not use it reliably). The server also gets this project's compact
scoring endpoint (`/opd/score`, `trl_opd/server_route`), which the trainer uses where a server has it; the stock
OpenAI endpoints stay as they are. Extra arguments go to vLLM unchanged and win over these defaults.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# The compact scoring endpoint, imported by the server from ROUTE_DIR (which holds that one module only)
ROUTE_DIR = Path(__file__).parent / "server_route"
SCORING_ROUTE = "opd_scoring_route.opd_scoring"


def server_env(environ: dict) -> dict:
    """The server's environment: `environ` with ROUTE_DIR first on its PYTHONPATH."""
    paths = [str(ROUTE_DIR), *filter(None, environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**environ, "PYTHONPATH": os.pathsep.join(paths)}


def vllm_command(model: str, *, python: str, host: str, port: int, max_logprobs: int, extra: list[str]) -> list[str]:
    """The server command line: vLLM's OpenAI-compatible API server with the flags teacher scoring needs."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host, "--port",
               str(port), "--max-logprobs", str(max_logprobs), "--no-enable-prefix-caching",
               "--logprobs-mode", "raw_logprobs", "--middleware", SCORING_ROUTE]
    given = {arg.split("=")[0] for arg in extra if arg.startswith("--")}
    for flag in ("--host", "--port", "--max-logprobs", "--logprobs-mode"):
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trl-opd serve-teacher", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="path or Hub id of the teacher")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-logprobs", type=int, default=20, help="the largest top-k the trainer may ask for")
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
    command = vllm_command(args.model, python=args.python, host=args.host, port=args.port,
                           max_logprobs=args.max_logprobs, extra=extra)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    print(" ".join(command))
    print(f"Teacher will serve at http://{host}:{args.port} once /health answers. In a recipe:\n"
          f"  teacher_server_url: http://{host}:{args.port}", flush=True)
    if not args.dry_run:
        os.execve(command[0], command, server_env(dict(os.environ)))
