"""The code tool environment's wire types (OpenEnv pydantic models): a tool call, its result, an episode's state."""

from __future__ import annotations

from typing import Any

from pydantic import Field

try:
    from openenv.core.env_server.types import Action, Observation, State
except ImportError as error:  # an optional extra: say which
    raise ImportError("The code tool environment needs openenv-core: pip install 'trl_opd[env]'") from error

TOOLS = ("run_python",)  # the tools the server serves; any other name is answered with an error naming these


class ToolCall(Action):
    """One tool call: `{"tool": "run_python", "arguments": {"code": "print(1)"}}`."""

    tool: str = Field(description="The tool's name: one of " + ", ".join(TOOLS))
    arguments: dict[str, Any] = Field(default_factory=dict, description="The tool's arguments by name")


class ToolResult(Observation):
    """What a tool call returned. `output` is what the agent sees: the snippet's stdout then its stderr, truncated
    (see `environment.format_output`), or, when the call was refused, the reason (also in `error`)."""

    output: str = Field(default="", description="What the agent sees: the snippet's output, or why it did not run")
    error: str | None = Field(default=None, description="Set when the call was refused; then nothing ran")
    exit_code: int | None = Field(default=None, description="The snippet's exit status; negative: killed by a signal")
    timed_out: bool = Field(default=False, description="Killed at the wall-clock time limit")
    truncated: bool = Field(default=False, description="The output was cut to the server's limit")
    cpu_s: float | None = Field(default=None, description="CPU seconds the snippet's main process used")
    turn: int = Field(default=0, description="Tool calls made in this episode, this one included")
    max_turns: int = Field(default=0, description="Tool calls an episode allows")


class CodeToolState(State):
    """An episode: the program it is about (if the reset named one), its answer, and the tool calls made."""

    program: str | None = Field(default=None, description="The program the agent is asked about")
    solution: str | None = Field(default=None, description="What the program prints")
    max_turns: int = Field(default=0, description="Tool calls an episode allows")
    done: bool = Field(default=False, description="No more tool calls: the turn limit was reached")
