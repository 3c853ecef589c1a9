"""A two-step arithmetic task for a tool-using agent, deterministic and offline.

Each question, "What is (a + b) * c?" or "What is a * b + c?", takes two tool calls whose second argument chain
depends on the first result, then a final answer. The model never does arithmetic itself: it copies numbers from the
question and from tool results, so a tiny model can learn it in seconds.

    trainer = GRPOTrainer(..., train_dataset=arithmetic_tool_dataset(64, seed=0), environment_factory=ArithmeticToolEnv)
"""

from __future__ import annotations

import json
import random
import re

_ADD_THEN_MULTIPLY = re.compile(r"\((-?\d+) \+ (-?\d+)\) \* (-?\d+)")
_MULTIPLY_THEN_ADD = re.compile(r"(-?\d+) \* (-?\d+) \+ (-?\d+)")


class ArithmeticToolEnv:
    """Serves `add` and `multiply` to one rollout and records what it served.

    For `environment_factory`: instances are pooled and `reset` is called with each row's columns before its
    rollout. There is deliberately no `get_reward` (it would become a reward function); score with
    `tool_answer_reward` or `tool_env_reward`.
    """

    def __init__(self) -> None:
        self.row: dict = {}
        self.calls: list[tuple[str, int, int, int]] = []  # (tool, a, b, result)

    def reset(self, **row) -> None:
        """Start a rollout for `row` (its dataset columns); nothing is added to the prompt."""
        self.row = row
        self.calls = []
        return None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return self._serve("add", a, b, add(a, b))

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return self._serve("multiply", a, b, multiply(a, b))

    def _serve(self, name: str, a: int, b: int, result: int) -> int:
        self.calls.append((name, int(a), int(b), result))
        return result


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return int(a) + int(b)


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return int(a) * int(b)


# The same tools as plain functions, for GRPO's `tools=` path (no per-rollout state)
ARITHMETIC_TOOLS = [add, multiply]


def arithmetic_tool_rows(n: int, seed: int, *, low: int = 1, high: int = 12) -> list[dict]:
    """`n` rows {"prompt": [{"role": "user", ...}], "answer": "N"}, half of each question form, seeded."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, c = (rng.randint(low, high) for _ in range(3))
        if rng.random() < 0.5:
            question, value = f"What is ({a} + {b}) * {c}?", (a + b) * c
        else:
            question, value = f"What is {a} * {b} + {c}?", a * b + c
        rows.append({"prompt": [{"role": "user", "content": question}], "answer": str(value)})
    return rows


def arithmetic_tool_dataset(n: int, seed: int):
    """`arithmetic_tool_rows` as a `datasets.Dataset` with columns `prompt` (chat messages) and `answer` (str)."""
    from datasets import Dataset

    return Dataset.from_list(arithmetic_tool_rows(n, seed))


def _tool_call(name: str, a: int, b: int) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {"a": a, "b": b}}}]}


def gold_trajectory(row: dict) -> list[dict]:
    """The whole conversation of a correct solution: the row's prompt, two tool calls with their results, the answer.

    Tool calls are in the chat-template format ({"role": "assistant", "tool_calls": [{"type": "function", "function":
    {"name", "arguments"}}]}), followed by {"role": "tool", "name", "content"}; the last message is
    {"role": "assistant", "content": "The answer is N."}.
    """
    question = row["prompt"][-1]["content"]
    if match := _ADD_THEN_MULTIPLY.search(question):
        a, b, c = map(int, match.groups())
        steps = [("add", a, b), ("multiply", a + b, c)]
    elif match := _MULTIPLY_THEN_ADD.search(question):
        a, b, c = map(int, match.groups())
        steps = [("multiply", a, b), ("add", a * b, c)]
    else:
        raise ValueError(f"Not an arithmetic tool question: {question!r}")
    messages = list(row["prompt"])
    for name, x, y in steps:
        result = x + y if name == "add" else x * y
        messages += [_tool_call(name, x, y), {"role": "tool", "name": name, "content": str(result)}]
    messages.append({"role": "assistant", "content": f"The answer is {result}."})
    return messages


def final_answer(completion: list[dict] | str) -> str | None:
    """The last number of the completion's final message, if that message is an assistant answer (not a tool call)."""
    if isinstance(completion, list):
        if not completion or completion[-1].get("role") != "assistant" or completion[-1].get("tool_calls"):
            return None
        completion = completion[-1].get("content") or ""
    numbers = re.findall(r"-?\d+", completion)
    return numbers[-1] if numbers else None


def tool_answer_reward(completions, answer, **kwargs) -> list[float]:
    """GRPO reward: 1.0 if the final assistant message's last number equals `answer`, else 0.0."""
    return [float(final_answer(c) == str(a)) for c, a in zip(completions, answer, strict=True)]


def tool_env_reward(environments, answer, **kwargs) -> list[float]:
    """GRPO reward from the environments: 1.0 if the last tool result served equals `answer` (it was reached)."""
    return [float(bool(e.calls) and str(e.calls[-1][-1]) == str(a)) for e, a in zip(environments, answer, strict=True)]


def tool_call_stats(completions: list[list[dict]]) -> dict[str, float]:
    """How a sampled policy uses the tools, as means over completions (lists of messages).

    `tool_calls`: parsed calls made; `tool_use`: completions with at least one parsed call; `malformed`: completions
    with an assistant turn that tried to call a tool but did not parse (its raw `<tool_call>` text stayed content).
    """
    calls = used = malformed = 0
    for completion in completions:
        turns = [m for m in completion if m.get("role") == "assistant"]
        made = sum(len(m.get("tool_calls") or []) for m in turns)
        calls, used = calls + made, used + (made > 0)
        malformed += any("<tool_call>" in (m.get("content") or "") for m in turns)
    n = max(len(completions), 1)
    return {"tool_calls": calls / n, "tool_use": used / n, "malformed": malformed / n}


def write_rows(path, rows: list[dict]) -> None:
    """Rows as JSON lines."""
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
