"""Clients of the code tool server: OpenEnv's WebSocket `EnvClient` for it, and `CodeToolClient`, the environment
class for GRPO's `environment_factory` (in a recipe: `environment_factory: trl_opd.envs.code_env.CodeToolClient`).

TRL pools `CodeToolClient` instances, calls `reset(**row)` before each rollout and offers `run_python` to the model
as a tool. The server's URL comes from `OPD_ENV_SERVER_URL` (or the constructor). Each instance holds one WebSocket
session, opened at its first reset and reused for later episodes.

Failures are never an empty observation. A reset that cannot reach the server is retried `RETRIES` times (backoff
0.5, 1, 2 s), then raises `EnvServerError` naming the URL; TRL does not catch it there, so training stops. A tool
call whose connection is lost, or whose answer is not a code tool result (not JSON, no string `output`, a field of
the wrong type), raises `EnvServerError` at once (the episode lived in that server session) and sets `failure`:
TRL turns an exception in a tool into an `{"error": ...}` tool message for the model, and `OPDTrainer` then stops
before that batch is scored or trained on (`trl_opd.trainer.multiturn.check_environments`).
"""

from __future__ import annotations

import os
import re
import time
import weakref

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from pydantic import ValidationError
from websockets.exceptions import WebSocketException

from .models import CodeToolState, ToolCall, ToolResult

ENV_VAR = "OPD_ENV_SERVER_URL"
RETRIES = 3  # after the first attempt, for a reset: backoff BACKOFF_S, then doubled each time
BACKOFF_S = 0.5
_FENCED_PYTHON = re.compile(r"```python\n(.*?)\n```", flags=re.DOTALL)
# a connection that cannot be made or was lost (OSError covers ConnectionError and TimeoutError)
_TRANSPORT_ERRORS = (OSError, WebSocketException)


class EnvServerError(RuntimeError):
    """The environment server could not be reached, refused a request or answered one with something that is not a
    code tool result; the message names its URL."""


class MalformedAnswer(ValueError):
    """An answer of the server that is not a code tool result."""


def _excerpt(payload, limit: int = 200) -> str:
    text = repr(payload)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class CodeToolEnvClient(EnvClient[ToolCall, ToolResult, CodeToolState]):
    """OpenEnv's async WebSocket client for the code tool server (`.sync()` for a blocking one): one connection is
    one server session with its own environment."""

    def _step_payload(self, action: ToolCall) -> dict:
        return action.model_dump(exclude={"metadata"})

    def _parse_result(self, payload: dict) -> StepResult[ToolResult]:
        """The server's answer as a result. An answer that is not a code tool result raises `MalformedAnswer`: it
        must never reach the model as an empty or made-up observation."""
        observation = payload.get("observation") if isinstance(payload, dict) else None
        if not isinstance(observation, dict) or not isinstance(observation.get("output"), str):
            raise MalformedAnswer(f"no observation with a string 'output' in {_excerpt(payload)}")
        done, reward = payload.get("done", False), payload.get("reward")
        try:
            result = ToolResult(**observation, done=done, reward=reward)
        except ValidationError as error:
            raise MalformedAnswer(f"{error.error_count()} invalid field(s) in {_excerpt(payload)}") from error
        return StepResult(observation=result, reward=reward, done=result.done)

    def _parse_state(self, payload: dict) -> CodeToolState:
        return CodeToolState(**payload)


def program_of(row: dict) -> str | None:
    """The program a code-output row asks about: its `program` column, else the fenced code in its last message."""
    if row.get("program"):
        return row["program"]
    prompt = row.get("prompt")
    text = prompt[-1].get("content") if isinstance(prompt, list) and prompt else prompt
    match = _FENCED_PYTHON.search(text) if isinstance(text, str) else None
    return match.group(1) if match else None


class CodeToolClient:
    """A rollout's view of the code tool server: `reset(**row)` starts an episode, `run_python` is the tool.

    Only `reset` and `run_python` are public: TRL offers every other public method to the model as a tool.
    `calls` lists this episode's (code, output) pairs; `done` is set when the server's turn limit was reached.
    """

    def __init__(self, base_url: str | None = None, *, retries: int = RETRIES, backoff_s: float = BACKOFF_S,
                 message_timeout_s: float = 300.0):
        url = base_url or os.environ.get(ENV_VAR)
        if not url:
            raise ValueError(f"No environment server URL: set {ENV_VAR} (e.g. http://127.0.0.1:8765) or pass "
                             "base_url. Start a server with `trl-opd serve-env --port 8765`.")
        self.base_url = url.rstrip("/")
        self._retries, self._backoff_s, self._message_timeout_s = retries, backoff_s, message_timeout_s
        # openenv's SyncEnvClient, connected at the first reset; in a list that the finalizer shares, so that whichever
        # is open is closed when this client is collected or at exit (while its event loop's thread still runs)
        self._open: list = []
        weakref.finalize(self, _close_all, self._open)
        self.calls: list[tuple[str, str]] = []
        self.done = False
        self.failure: str | None = None  # a lost server mid-episode: OPDTrainer stops before training on it

    def reset(self, **row) -> None:
        """Start an episode for a dataset row (its `program`, or the code in its prompt, and `solution` are sent)."""
        self.calls, self.done, self.failure = [], False, None
        episode = {"program": program_of(row), "solution": row.get("solution")}
        self._request("reset", lambda session: session.reset(**episode), attempts=1 + self._retries)
        return None  # the row's prompt already shows the program

    def run_python(self, code: str) -> str:
        """Run a Python snippet in a sandbox and return what it printed (stdout, then stderr).

        Each call starts a fresh interpreter in an empty scratch directory, without network access and with time and
        memory limits; nothing persists between calls, so print every value you need.

        Args:
            code: The Python source code to run.
        """
        call = ToolCall(tool="run_python", arguments={"code": code})
        try:
            result = self._request("run_python call", lambda session: session.step(call), attempts=1)
        except EnvServerError as error:
            self.failure = str(error)
            raise
        self.done = result.done
        self.calls.append((code, result.observation.output))
        return result.observation.output

    def _request(self, what: str, send, *, attempts: int):
        error = None
        for attempt in range(attempts):
            if attempt:
                time.sleep(self._backoff_s * 2 ** (attempt - 1))
            try:
                return send(self._connected())
            except _TRANSPORT_ERRORS as lost:
                error = lost
                self._disconnect()
            except ValueError as malformed:  # not JSON (json.JSONDecodeError) or not a tool result (MalformedAnswer)
                self._disconnect()
                raise EnvServerError(f"The environment server at {self.base_url} sent a malformed answer to the "
                                     f"{what}: {malformed}") from malformed
            except RuntimeError as refused:  # EnvClient's "Server error: ..." answer
                raise EnvServerError(f"The environment server at {self.base_url} refused the {what}: {refused}"
                                     ) from refused
        lost_episode = "" if attempts > 1 else "; the episode in that session is lost"
        raise EnvServerError(f"The environment server at {self.base_url} did not answer the {what} "
                             f"({attempts} attempt{'s' * (attempts > 1)}{lost_episode}): "
                             f"{type(error).__name__}: {error}") from error

    def _connected(self):
        if not self._open:
            session = CodeToolEnvClient(self.base_url, connect_timeout_s=5.0,
                                        message_timeout_s=self._message_timeout_s).sync()
            self._open.append(session)
            session.connect()
        return self._open[0]

    def _disconnect(self) -> None:
        _close_all(self._open)


def _close_all(sessions: list) -> None:
    while sessions:
        try:
            sessions.pop().close()
        except Exception:  # closing a connection that is already gone
            pass
