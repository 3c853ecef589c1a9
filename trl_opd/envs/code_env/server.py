"""`trl-opd serve-env` (or `python -m trl_opd.envs.code_env.server`): the code tool environment as an OpenEnv server.

    trl-opd serve-env --host 127.0.0.1 --port 8765      # then OPD_ENV_SERVER_URL=http://127.0.0.1:8765

Routes are OpenEnv's (`create_fastapi_app`): `/health`, `/schema`, `/metadata`, and the WebSocket `/ws`, where each
connection is one session holding its own environment, so an episode's turns stay together (`CodeToolClient` uses
it). In openenv-core 0.3.0 the plain HTTP `/reset` and `/step` build a fresh environment per request: an HTTP
`/step` therefore answers "No episode" and runs nothing. Malformed actions are refused by OpenEnv's validation: an
HTTP 422, or an error message on the WebSocket.

The sandbox is checked before anything is served: where it cannot confine snippets (not root, no `unshare`, a
namespace or mount refused), the server prints why and exits with status 2; it never runs code unconfined.
"""

from __future__ import annotations

import argparse
import functools
import sys

from .sandbox import Sandbox, SandboxUnavailable


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-opd serve-env", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--max-turns", type=int, default=8, help="tool calls per episode")
    parser.add_argument("--max-output", type=int, default=1024, help="characters of output per tool call")
    parser.add_argument("--wall-time", type=float, default=10.0, help="seconds a snippet may run")
    parser.add_argument("--cpu-time", type=int, default=5, help="CPU seconds a snippet process may use")
    parser.add_argument("--memory-mb", type=int, default=512, help="address space of a snippet process")
    parser.add_argument("--file-mb", type=int, default=8, help="largest file a snippet may write")
    parser.add_argument("--scratch-mb", type=int, default=16, help="size of a snippet's scratch directory")
    parser.add_argument("--max-parallel", type=int, default=None,
                        help="snippets running at once, others wait (default: the CPU count, at least 2)")
    parser.add_argument("--max-sessions", type=int, default=256,
                        help="WebSocket sessions at once: at least the rollouts a training step runs together")
    parser.add_argument("--session-timeout", type=float, default=900.0,
                        help="seconds after which an idle session is closed")
    parser.add_argument("--unshare", default="unshare", help="util-linux's unshare")
    return parser


def make_app(sandbox: Sandbox, *, max_turns: int, max_output: int, max_sessions: int, session_timeout: float | None):
    """OpenEnv's FastAPI app serving `CodeToolEnvironment`s that share `sandbox` (already checked); the settings'
    defaults are the command's (`build_parser`)."""
    from openenv.core.env_server import ConcurrencyConfig, create_fastapi_app

    from .environment import CodeToolEnvironment
    from .models import ToolCall, ToolResult

    factory = functools.partial(CodeToolEnvironment, sandbox, max_turns=max_turns, max_output=max_output)
    concurrency = ConcurrencyConfig(max_concurrent_envs=max_sessions, session_timeout=session_timeout)
    app = create_fastapi_app(factory, ToolCall, ToolResult, concurrency_config=concurrency)
    # on a graceful stop (SIGTERM, Ctrl-C) uvicorn re-raises the signal after shutdown, so no `finally` of main runs
    app.router.on_shutdown.append(sandbox.close)
    return app


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sandbox = Sandbox(wall_s=args.wall_time, cpu_s=args.cpu_time, memory_mb=args.memory_mb, file_mb=args.file_mb,
                      scratch_mb=args.scratch_mb, max_parallel=args.max_parallel,
                      keep_bytes=4 * (args.max_output + 1), unshare=args.unshare)
    try:
        sandbox.check()  # before importing the server: a machine that cannot sandbox is told so at once
    except SandboxUnavailable as error:
        sandbox.close()
        print(f"trl-opd serve-env: refusing to start: {error}", file=sys.stderr)
        sys.exit(2)
    try:
        import uvicorn

        app = make_app(sandbox, max_turns=args.max_turns, max_output=args.max_output, max_sessions=args.max_sessions,
                       session_timeout=args.session_timeout)
        print(f"Code tool environment on http://{args.host}:{args.port} (sandbox: {sandbox.wall_s:g} s wall, "
              f"{sandbox.cpu_s} s CPU, {sandbox.memory_mb} MiB, {sandbox.max_parallel} at once; "
              f"{args.max_turns} turns, {args.max_output} characters of output)", flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        sandbox.close()


if __name__ == "__main__":
    main()
