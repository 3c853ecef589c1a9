"""The code tool environment (an OpenEnv `Environment`): an episode per rollout, `run_python` as its one tool.

An episode starts with `reset(program=..., solution=...)` (both optional: they are recorded in the state, the
agent's prompt already shows the program). Each step is one tool call, `ToolCall(tool="run_python",
arguments={"code": ...})`, which runs the snippet in a fresh sandbox (`sandbox.py`) and returns its output:

- the snippet's stdout, then its stderr, cut to `max_output` characters (`--max-output`, default 1024) followed by
  `[output truncated: the first N characters are shown]` when longer;
- then one note on how it ended, if not normally: `[killed: ran past the time limit of S s]`, `[killed: used more than
  the CPU time limit of S s]` (all its processes together), `[killed: used more than the memory limit of M MiB]`
  (where a cgroup holds the snippet), `[killed by signal NAME]`, or `[exit code N]` (Python's traceback is in
  stderr).

Every call counts as a turn, refused or not. The call that reaches `max_turns` (`--max-turns`, default 8) runs and
ends the episode (`done`); calls after it, calls before any reset, an unknown tool name, and arguments other than one
string `code` are answered with an error observation (`error` set, nothing run) naming what is accepted.
"""

from __future__ import annotations

import signal
import threading
import uuid

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import EnvironmentMetadata

from .models import TOOLS, CodeToolState, ToolCall, ToolResult
from .sandbox import RunResult, Sandbox

TRUNCATED = "[output truncated: the first {limit} characters are shown]"


def format_output(result: RunResult, *, max_output: int, wall_s: float, cpu_s: int, memory_mb: int = 0
                  ) -> tuple[str, bool]:
    """What the agent sees of a run, and whether it was truncated (see the module docstring)."""
    text = result.stdout
    if result.stderr:
        text += ("\n" if text and not text.endswith("\n") else "") + result.stderr
    truncated = result.clipped or len(text) > max_output
    notes = [TRUNCATED.format(limit=max_output)] if truncated else []
    text = text[:max_output]
    code = result.exit_code
    if result.timed_out:
        notes.append(f"[killed: ran past the time limit of {wall_s:g} s]")
    elif result.over_cpu or code == -signal.SIGXCPU:
        notes.append(f"[killed: used more than the CPU time limit of {cpu_s} s]")
    elif result.out_of_memory:
        notes.append(f"[killed: used more than the memory limit of {memory_mb} MiB]")
    elif code is not None and code < 0:
        notes.append(f"[killed by signal {signal.Signals(-code).name}]")
    elif code:
        notes.append(f"[exit code {code}]")
    if notes:
        text += ("\n" if text and not text.endswith("\n") else "") + "\n".join(notes)
    return text, truncated


class CodeToolEnvironment(Environment[ToolCall, ToolResult, CodeToolState]):
    """One session's episodes. Sessions share the server's `Sandbox` (its slots bound how many snippets run at once)
    and nothing else, so the server may hold many at a time."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, sandbox: Sandbox, *, max_turns: int, max_output: int):
        super().__init__()
        self.sandbox, self.max_turns, self.max_output = sandbox, max_turns, max_output
        self._state: CodeToolState | None = None

    def reset(self, seed: int | None = None, episode_id: str | None = None, program: str | None = None,
              solution: str | None = None, **kwargs) -> ToolResult:
        self._state = CodeToolState(episode_id=episode_id or uuid.uuid4().hex, program=program, solution=solution,
                                    max_turns=self.max_turns)
        return ToolResult(max_turns=self.max_turns)

    def step(self, action: ToolCall, timeout_s: float | None = None, cancel: threading.Event | None = None,
             **kwargs) -> ToolResult:
        """One tool call; `cancel`, when set by the server, kills its snippet (the client went away)."""
        state = self._state
        if state is None:
            return self._refuse("No episode: reset the environment before calling a tool.", turn=0, done=True)
        if state.done:
            return self._refuse(f"The episode is over: it allows {self.max_turns} tool calls, and all were made.",
                                turn=state.step_count, done=True)
        state.step_count += 1
        state.done = state.step_count >= self.max_turns
        if action.tool not in TOOLS:
            return self._refuse(f"Unknown tool {action.tool!r}. Known tools: {', '.join(TOOLS)}.",
                                turn=state.step_count, done=state.done)
        code = action.arguments.get("code")
        if set(action.arguments) != {"code"} or not isinstance(code, str):
            return self._refuse("run_python takes one argument, `code` (Python source, a string); got "
                                f"{sorted(action.arguments)}.", turn=state.step_count, done=state.done)
        try:
            result = self.sandbox.run(code, cancel)
        except ValueError as error:  # a snippet over the size limit
            return self._refuse(str(error), turn=state.step_count, done=state.done)
        output, truncated = format_output(result, max_output=self.max_output, wall_s=self.sandbox.wall_s,
                                          cpu_s=self.sandbox.cpu_s, memory_mb=self.sandbox.memory_mb)
        return ToolResult(output=output, exit_code=result.exit_code, timed_out=result.timed_out,
                          truncated=truncated, cpu_s=result.cpu_s, turn=state.step_count, max_turns=self.max_turns,
                          done=state.done)

    def _refuse(self, error: str, *, turn: int, done: bool) -> ToolResult:
        return ToolResult(output=f"Error: {error}", error=error, turn=turn, max_turns=self.max_turns, done=done)

    @property
    def state(self) -> CodeToolState:
        return self._state or CodeToolState(max_turns=self.max_turns)

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(name="code_tool", version="1.0.0",
                                   description="Run Python snippets in a sandbox (tool: run_python), then answer "
                                               "what a program prints.")
