"""`trl-opd serve-env` (or `python -m trl_opd.envs.code_env.server`): the code tool environment as an OpenEnv server.

    trl-opd serve-env --host 127.0.0.1 --port 8765      # then OPD_ENV_SERVER_URL=http://127.0.0.1:8765

It serves four routes and nothing else (every other path is a 404): `GET /health`, `GET /metadata` (the
environment and the sandbox's limits), `GET /schema` (the JSON schemas of a tool call, its result and an episode's
state) and the WebSocket `/ws`, which speaks OpenEnv's session protocol (`reset`, `step`, `state`, `close` messages;
OpenEnv's `EnvClient` and `CodeToolClient` use it). A session is its connection: it holds one environment, so an
episode's turns stay together, and it ends when the connection does, so `--max-sessions` counts connections only.
A frame that is not a JSON object of a known type (binary, not JSON, an array, a bad action) is answered with an
error message and the session goes on. When a client goes away during a tool call, its snippet is killed at once.
A session idle for `--session-timeout` seconds is closed.

The sandbox is checked before anything is served: where it cannot confine snippets (neither root nor unprivileged
user namespaces, no libseccomp, a namespace or mount refused), the server prints why and exits with status 2; it
never runs code unconfined.
"""

import argparse
import asyncio
import functools
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from .sandbox import Sandbox, SandboxCancelled, SandboxUnavailable


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-opd serve-env", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--max-turns", type=int, default=8, help="tool calls per episode")
    parser.add_argument("--max-output", type=int, default=1024, help="characters of output per tool call")
    parser.add_argument("--wall-time", type=float, default=10.0, help="seconds a snippet may run")
    parser.add_argument("--cpu-time", type=int, default=5, help="CPU seconds of all of a snippet's processes")
    parser.add_argument("--memory-mb", type=int, default=512, help="memory of all of a snippet's processes")
    parser.add_argument("--processes", type=int, default=None,
                        help="processes a snippet may run at once (default: 16 in a cgroup, else memory-mb / 64)")
    parser.add_argument("--file-mb", type=int, default=8, help="largest file a snippet may write")
    parser.add_argument("--scratch-mb", type=int, default=16, help="size of a snippet's scratch directory")
    parser.add_argument("--max-parallel", type=int, default=None,
                        help="snippets running at once, others wait (default: the CPU count, at least 2)")
    parser.add_argument("--max-sessions", type=int, default=256,
                        help="WebSocket sessions at once: at least the rollouts a training step runs together")
    parser.add_argument("--session-timeout", type=float, default=900.0,
                        help="seconds after which an idle session is closed")
    return parser


def _error(message: str, code: str, **details) -> str:
    return json.dumps({"type": "error", "data": {"message": message, "code": code, **details}})


class Sessions:
    """The WebSocket sessions: at most `max_sessions` at once, each with its own environment; the tool calls run in
    threads of their own (a session has at most one call in flight)."""

    def __init__(self, factory, *, max_sessions: int, session_timeout: float | None):
        self.factory, self.max_sessions, self.session_timeout = factory, max_sessions, session_timeout
        self.active = 0
        self.executor = ThreadPoolExecutor(max_workers=max_sessions, thread_name_prefix="session")

    async def serve(self, websocket) -> None:
        await websocket.accept()
        if self.active >= self.max_sessions:
            await websocket.send_text(_error(f"The server holds its maximum of {self.max_sessions} sessions; try "
                                             "again when one ends.", "CAPACITY_REACHED",
                                             active_sessions=self.active, max_sessions=self.max_sessions))
            await websocket.close()
            return
        self.active += 1
        try:
            await self._session(websocket, self.factory())
        finally:
            self.active -= 1

    async def _session(self, websocket, environment) -> None:
        receiving = None
        while True:
            receiving = receiving or asyncio.ensure_future(websocket.receive())
            try:
                frame = await asyncio.wait_for(asyncio.shield(receiving), timeout=self.session_timeout)
            except asyncio.TimeoutError:
                receiving.cancel()
                await websocket.send_text(_error(f"The session was idle for {self.session_timeout:g} s and is "
                                                 "closed.", "SESSION_ERROR"))
                await websocket.close()
                return
            receiving = None
            if frame["type"] == "websocket.disconnect":
                return
            message, answer = _parse(frame)
            if answer is None and message["type"] == "close":
                await websocket.close()
                return
            if answer is None:
                answer, receiving = await self._answer(websocket, environment, message)
                if answer is None:  # the client went away during a tool call; its snippet was killed
                    return
            await websocket.send_text(answer)

    async def _answer(self, websocket, environment, message: dict):
        """The answer to a valid message, and the next frame's receive if one was started meanwhile; (None, None)
        when the client disconnected while a tool call ran."""
        from openenv.core.env_server.serialization import serialize_observation
        from pydantic import ValidationError

        from .models import ToolCall

        loop = asyncio.get_running_loop()
        try:
            if message["type"] == "state":
                return json.dumps({"type": "state", "data": environment.state.model_dump()}), None
            if message["type"] == "reset":
                observation = await loop.run_in_executor(self.executor, lambda: environment.reset(**message["data"]))
                return json.dumps({"type": "observation", "data": serialize_observation(observation)}), None
            action = ToolCall.model_validate(message["data"])
        except ValidationError as invalid:
            return _invalid(invalid), None
        except Exception as error:  # a reset's bad argument: the session goes on
            return _error(str(error), "EXECUTION_ERROR"), None
        cancel = threading.Event()
        step = loop.run_in_executor(self.executor, functools.partial(environment.step, action, cancel=cancel))
        receiving = asyncio.ensure_future(websocket.receive())
        await asyncio.wait({step, receiving}, return_when=asyncio.FIRST_COMPLETED)
        if receiving.done() and receiving.result()["type"] == "websocket.disconnect":
            cancel.set()
            try:
                await step
            except SandboxCancelled:
                pass
            return None, None
        try:
            observation = await step
        except Exception as error:  # the sandbox failed on its side: say so, and go on
            return _error(f"The tool call failed on the server: {error}", "EXECUTION_ERROR"), receiving
        return json.dumps({"type": "observation", "data": serialize_observation(observation)}), receiving


def _parse(frame: dict) -> tuple[dict | None, str | None]:
    """A frame as (a message of a known type, None), or (None, the error to answer)."""
    if frame.get("text") is None:
        return None, _error("Binary frames are not accepted: send each message as JSON text.", "INVALID_JSON")
    try:
        message = json.loads(frame["text"])
    except json.JSONDecodeError as error:
        return None, _error(f"Invalid JSON: {error}", "INVALID_JSON")
    if not isinstance(message, dict):
        return None, _error(f"A message is a JSON object with a `type`, not a {type(message).__name__}.",
                            "VALIDATION_ERROR")
    kind = message.get("type")
    if kind not in ("reset", "step", "state", "close"):
        return None, _error(f"Unknown message type: {kind!r} (known: reset, step, state, close)", "UNKNOWN_TYPE")
    data = message.get("data", {})
    if not isinstance(data, dict):
        return None, _error(f"A message's `data` is a JSON object, not a {type(data).__name__}.", "VALIDATION_ERROR")
    return {"type": kind, "data": data}, None


def _invalid(error) -> str:
    errors = error.errors(include_url=False, include_context=False, include_input=False)
    return _error("Invalid message", "VALIDATION_ERROR", errors=errors)


def make_app(sandbox: Sandbox, *, max_turns: int, max_output: int, max_sessions: int, session_timeout: float | None):
    """The FastAPI app serving `CodeToolEnvironment`s that share `sandbox` (already checked); the settings'
    defaults are the command's (`build_parser`)."""
    from fastapi import FastAPI, WebSocket

    from .environment import CodeToolEnvironment
    from .models import CodeToolState, ToolCall, ToolResult

    factory = functools.partial(CodeToolEnvironment, sandbox, max_turns=max_turns, max_output=max_output)
    sessions = Sessions(factory, max_sessions=max_sessions, session_timeout=session_timeout)
    app = FastAPI(title="trl_opd code tool environment", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    def health() -> dict:
        return {"status": "healthy"}

    @app.get("/metadata")
    def metadata() -> dict:
        return {**factory().get_metadata().model_dump(), "max_turns": max_turns, "max_output": max_output,
                "sandbox": sandbox.limits()}

    @app.get("/schema")
    def schema() -> dict:
        return {"action": ToolCall.model_json_schema(), "observation": ToolResult.model_json_schema(),
                "state": CodeToolState.model_json_schema()}

    @app.websocket("/ws")
    async def websocket(connection: WebSocket) -> None:
        await sessions.serve(connection)

    # on a graceful stop (SIGTERM, Ctrl-C) uvicorn re-raises the signal after shutdown, so no `finally` of main runs
    app.router.on_shutdown.append(sandbox.close)
    app.router.on_shutdown.append(lambda: sessions.executor.shutdown(wait=False, cancel_futures=True))
    return app


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sandbox = Sandbox(wall_s=args.wall_time, cpu_s=args.cpu_time, memory_mb=args.memory_mb, file_mb=args.file_mb,
                      scratch_mb=args.scratch_mb, max_parallel=args.max_parallel, processes=args.processes,
                      keep_bytes=4 * (args.max_output + 1))
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
        limits = sandbox.limits()
        print(f"Code tool environment on http://{args.host}:{args.port} (sandbox: {limits['privileges']}; per "
              f"snippet {sandbox.wall_s:g} s wall, {sandbox.cpu_s} s CPU, {sandbox.memory_mb} MiB and "
              f"{sandbox.processes} processes ({sandbox.budget}); {sandbox.max_parallel} at once; "
              f"{args.max_turns} turns, {args.max_output} characters of output)", flush=True)
        if not sandbox.cgroups:
            print(f"  no cgroup for the snippets: {sandbox.budget_reason}; each process gets "
                  f"{sandbox.memory_mb // sandbox.processes} MiB of address space", flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        sandbox.close()


if __name__ == "__main__":
    main()
