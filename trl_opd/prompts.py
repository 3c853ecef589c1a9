"""The prompt the teacher sees: the student's, as the student saw it, plus the teacher's own context.

The student's prompt is taken after GRPO has appended an environment's `reset()` observation to its last message, so
the teacher sees everything the student saw. A teacher-only system message goes in front of it; a template fills its
last user message from the row (`{prompt}` the message as the student read it); a teacher prompt column replaces it,
with the same observation appended.
"""

from __future__ import annotations

import string


def teacher_context(args) -> dict:
    """`teacher_prompt`'s keyword arguments from an `OPDConfig`."""
    return dict(column=args.teacher_prompt_column, system=args.teacher_system_prompt,
                template=args.teacher_prompt_template)


def teacher_prompt(row: dict, seen, *, column: str | None = None, system: str | None = None,
                   template: str | None = None):
    """The teacher's prompt (text or chat messages) for dataset `row`, whose prompt the student `seen`."""
    if column:
        return _with_observation(row[column], _observation(row["prompt"], seen))
    if template:
        seen = _from_template(template, row, seen)
    return with_system_message(seen, system) if system else seen


def template_columns(template: str) -> list[str]:
    """The row's columns `template` reads (every `{name}` but `{prompt}`); a template that is not one is refused."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as error:
        raise ValueError(f"teacher_prompt_template {template!r} is not a template ({error}); write a literal brace "
                         "as '{{' or '}}'.") from None
    bad = [name for name in fields if not name.isidentifier()]
    if bad or not fields:
        raise ValueError(f"teacher_prompt_template {template!r} must name the row's columns as {{column}}, e.g. "
                         "'{prompt}\\n\\nThe expected output is: {solution}'" + (f", not {bad}." if bad else "."))
    return sorted({name for name in fields if name != "prompt"})


def _from_template(template: str, row: dict, seen):
    """`seen` with its last user message (all of a text prompt) replaced by `template` filled from `row`, with the
    text it replaces as `{prompt}`."""
    if isinstance(seen, str):
        return template.format_map({**row, "prompt": seen})
    last = seen[-1]
    if last["role"] != "user" or not isinstance(last["content"], str):
        raise ValueError(
            "teacher_prompt_template fills the prompt's last message, which must be a user message of text; this "
            f"prompt ends with a {last['role']} message of {type(last['content']).__name__}. Use "
            "teacher_prompt_column to give the teacher a whole prompt of its own."
        )
    return [*seen[:-1], {**last, "content": template.format_map({**row, "prompt": last["content"]})}]


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
