"""What the teacher reads from a generated batch: the prompts (the student's, or a teacher-only prompt), the
completion as chat messages for a teacher with its own template, and the tools each prompt was rendered with.

The student's prompts and the tool loop's messages are those of the batch just generated (kept by
`OPDTrainer._generate`); a request is built from them at once, so that it may be sent later or from another thread.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from trl.trainer.utils import pad

from ..prompts import teacher_context, teacher_prompt
from ..teachers import TeacherScores

# Each function reads the trainer's `teacher` (the scorer) and the last generation's prompts and messages
# (`_student_prompts`, `_student_completions`), and GRPO's `args`, `_tokenizer`, `_tokenize_prompts`, `rollout_func`,
# `tools`, `environment_factories`, `_env_tools` and `_batch_environments`.


def teacher_request(trainer, inputs, output) -> Callable[[], TeacherScores]:
    """The teacher's scoring of a generated batch, ready to call: everything it reads from the trainer (the
    teacher's prompts, the routes) is taken now, so the call may run later or in another thread."""
    if trainer.args.ref_as_teacher and not trainer.args.teacher_own_prompt and "ref_per_token_logps" in output:
        scores = TeacherScores(logps=output["ref_per_token_logps"])  # GRPO computed them for its KL term
        return lambda: scores
    completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
    if trainer.args.teacher_tokenizer_mode == "cross":  # the teacher renders prompts and observations its own way
        batch = (teacher_prompt_messages(trainer, inputs, output), completion_ids, completion_mask,
                 output["action_mask"], completion_messages(trainer, inputs), prompt_tools(trainer, len(inputs)))
    else:
        batch = (*teacher_prompts(trainer, inputs, output), completion_ids, completion_mask)
    if trainer.args.teachers:
        routes = [row[trainer.args.teacher_route_column] for row in inputs]
        return partial(trainer.teacher.score, *batch, routes=routes)
    return partial(trainer.teacher.score, *batch)


def teacher_prompts(trainer, inputs, output) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt ids the teacher sees: the student's, or a teacher-only prompt (system message, template or
    column)."""
    if not trainer.args.teacher_own_prompt:
        return output["prompt_ids"], output["prompt_mask"]
    prompts = teacher_prompt_messages(trainer, inputs, output)
    prompt_ids = [torch.tensor(ids) for ids in trainer._tokenize_prompts(prompts)[0]]
    device = output["prompt_ids"].device
    padded = pad(prompt_ids, padding_value=trainer._tokenizer.pad_token_id, padding_side="left").to(device)
    mask = pad([torch.ones_like(ids) for ids in prompt_ids], padding_value=0, padding_side="left").to(device)
    return padded, mask


def teacher_prompt_messages(trainer, inputs, output) -> list:
    """The prompts the teacher reads, as text or chat messages: the student's as it saw them (with any observation
    an environment's reset() appended), plus any teacher-only prompt (system message, template or column)."""
    student_prompts = trainer._student_prompts
    if trainer.rollout_func is not None:
        check_rollout_prompts(trainer, student_prompts, output)
    return [teacher_prompt(row, seen, **teacher_context(trainer.args))
            for row, seen in zip(inputs, student_prompts, strict=True)]


def completion_messages(trainer, inputs) -> list[list[dict] | None]:
    """Each row's completion as chat messages, for a teacher that renders the observations between the student's
    turns with its own template: a rollout function's `completion_messages`, else the tool loop's messages (its
    parsed turns and tool results), else None."""
    loop = trainer._student_completions if trainer.tools else [None] * len(inputs)
    return [row.get("completion_messages", messages) for row, messages in zip(inputs, loop, strict=True)]


def prompt_tools(trainer, count: int) -> list:
    """The tools each row's prompt was rendered with: its environment's (GRPO renders each row with its own when
    there are environments), else the trainer's."""
    if trainer.environment_factories is not None:
        return [trainer._env_tools[name] for name in trainer._batch_environments]
    return [trainer.tools] * count


def check_rollout_prompts(trainer, student_prompts, output) -> None:
    """The teacher's own prompt (a teacher-only prompt, or a cross-tokenizer teacher's rendering) is built from the
    prompt messages; that is what the student read only if the rollout function rendered them as the trainer's
    chat template does. Refuse rather than compare two renderings."""
    rendered = trainer._tokenize_prompts(student_prompts)[0]
    for i, (ids, ids_mask) in enumerate(zip(output["prompt_ids"], output["prompt_mask"], strict=True)):
        if ids[ids_mask.bool()].tolist() != list(rendered[i]):
            raise ValueError(
                f"Row {i}: the rollout function's prompt_ids are not the student's prompt as the trainer's chat "
                "template renders it, so the teacher's own prompt (teacher_system_prompt, teacher_prompt_template, "
                "teacher_prompt_column, or a cross-tokenizer teacher's rendering) cannot be rendered to match. "
                "Render prompts with the trainer's processing class and chat template in the rollout function, "
                "or put the teacher's context in the rollout's own prompt."
            )
