"""Tool-use environments for multi-turn rollouts, and a tiny tool-using student/teacher pair built locally.

Importing this package is cheap: `datasets`, `transformers` and `torch` load inside the functions that need them,
and `make_tiny_agent` loads on first use (so `python -m trl_opd.envs.tiny_agent` runs cleanly).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .arithmetic import (
    ARITHMETIC_TOOLS,
    ArithmeticToolEnv,
    arithmetic_tool_dataset,
    arithmetic_tool_rows,
    final_answer,
    gold_trajectory,
    tool_answer_reward,
    tool_call_stats,
    tool_env_reward,
)

__all__ = [
    "ARITHMETIC_TOOLS",
    "ArithmeticToolEnv",
    "arithmetic_tool_dataset",
    "arithmetic_tool_rows",
    "final_answer",
    "gold_trajectory",
    "make_tiny_agent",
    "tool_answer_reward",
    "tool_call_stats",
    "tool_env_reward",
]

if TYPE_CHECKING:
    from .tiny_agent import make_tiny_agent


def __getattr__(name: str):
    if name == "make_tiny_agent":
        value = importlib.import_module("trl_opd.envs.tiny_agent").make_tiny_agent
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trl_opd.envs' has no attribute {name!r}")
