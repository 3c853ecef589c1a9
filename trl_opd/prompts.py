"""The prompt the teacher sees: the student's, as the student saw it, plus the teacher's own context.

The student's prompt is taken after GRPO has appended an environment's `reset()` observation to its last message, so
the teacher sees everything the student saw. A teacher-only system message goes in front of it; a teacher prompt
column replaces it, with the same observation appended.
"""

from __future__ import annotations


def teacher_prompt(row: dict, seen, *, column: str | None = None, system: str | None = None):
    """The teacher's prompt (text or chat messages) for dataset `row`, whose prompt the student `seen`."""
    if column:
        return _with_observation(row[column], _observation(row["prompt"], seen))
    return with_system_message(seen, system) if system else seen


def with_system_message(prompt, system: str):
    """`prompt` (text or chat messages) with a teacher-only system message in front of it."""
    if isinstance(prompt, str):
        return f"{system}\n\n{prompt}"
    if prompt and prompt[0]["role"] == "system":
        return [{"role": "system", "content": f"{system}\n\n{prompt[0]['content']}"}, *prompt[1:]]
    return [{"role": "system", "content": system}, *prompt]


def _observation(prompt, seen):
    """What an environment's `reset()` appended to the last message of `prompt` (GRPO appends it there) to give the
    prompt the student `seen`; None when nothing was appended."""
    if seen == prompt or isinstance(prompt, str):
        return None
    before, after = prompt[-1]["content"], seen[-1]["content"]
    if isinstance(after, list) and isinstance(before, str):
        before = [{"type": "text", "text": before}]
    return after[len(before):]


def _with_observation(prompt, observation):
    """`prompt` with `observation` appended to its last message's content, as GRPO appends a `reset()` observation."""
    if not observation:
        return prompt
    content = prompt[-1]["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return prompt[:-1] + [{**prompt[-1], "content": content + observation}]
