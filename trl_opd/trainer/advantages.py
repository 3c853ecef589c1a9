"""The teacher's advantages, combined with the rewards', and where they are formed: at generation, from the sampling
policy's log-probs, or, on-policy, inside the student's one loss forward.

`A[t] = opd_coef * (log pi_T - log pi_old)` needs the log-probs of the policy that sampled the batch. When GRPO trains
each generation batch once, within one optimizer step, and no sampler's log-probs need correcting, that policy is
the one the loss forward runs, and GRPO's loss takes the forward's own log-probs, detached, as the old ones. Forming
the advantage from those same log-probs, in that forward, gives the value a separate no-grad forward at generation
would (up to that forward's round-off) for one student forward a step instead of two.

At generation the batch keeps the teacher's scores and holds NaN where GRPO's loss reads the advantages, so that a
loss that ran without them could not pass for a healthy one; the loss forward's log-prob call is observed, and the
advantages are set in the batch before GRPO's loss reads them, a few lines after that call.
"""

from __future__ import annotations

import torch

from ..loss import constant_negative_advantages, opd_advantages
from ..teachers.base import TeacherScores

# The teacher's per-token scores a deferred batch keeps, by batch key and TeacherScores field
DEFERRED_SCORES = {"teacher_per_token_logps": "logps", "teacher_is_top1": "is_top1", "teacher_entropy": "entropy",
                   "teacher_chunk_ends": "chunk_ends"}


def set_advantages(inputs, scores: TeacherScores, old_per_token_logps, args, plan, *,
                   sum_over_processes=None) -> torch.Tensor:
    """The teacher's advantages `opd_coef * (log pi_T - log pi_old)` (B, T), put where GRPO's loss reads them: alone,
    summed with the rewards' (B,), or beside them for a second objective (`plan.combination`). In a control run
    (`plan.constant_advantage`), their mean magnitude over the batch's tokens on all processes instead, negated, on
    every token (`sum_over_processes` sums a tensor across them)."""
    mask = inputs["action_mask"]
    teacher_advantages = opd_advantages(
        scores.logps, old_per_token_logps, mask, coef=args.opd_coef, discount=args.kl_discount_factor,
        chunk_ends=scores.chunk_ends,
    )  # (B, T)
    if plan.constant_advantage:
        teacher_advantages = constant_negative_advantages(teacher_advantages, mask,
                                                          sum_over_processes=sum_over_processes)
    if plan.combination is None:
        inputs["advantages"] = teacher_advantages
    elif plan.combination == "advantage":
        reward_advantages = inputs["reward_advantages"][:, None] * mask  # (B, 1) -> (B, T)
        inputs["advantages"] = reward_advantages + args.opd_loss_coef * teacher_advantages
    else:
        inputs["teacher_advantages"] = teacher_advantages
    return teacher_advantages


def defer_advantages(output, scores: TeacherScores, plan, table_rows: torch.Tensor) -> None:
    """Keep the teacher's per-token scores in the batch and put NaN where GRPO's loss reads the advantages, until the
    loss forward forms them (`scores_kept`, `set_advantages`): a loss that ran without them could not pass for a
    healthy one. `table_rows` (B,) are the rows' places in GRPO's completions table."""
    for key, field in DEFERRED_SCORES.items():
        if getattr(scores, field) is not None:
            output[key] = getattr(scores, field)
    unformed = torch.full_like(scores.logps, float("nan"))
    if plan.combination == "loss":
        output["teacher_advantages"] = unformed  # GRPO's own reward advantages stay where they are
    else:
        output["advantages"] = unformed
    output["opd_table_row"] = table_rows


def is_deferred(inputs) -> bool:
    """The batch's teacher advantages are formed in its loss forward (`defer_advantages` kept its scores)."""
    return "teacher_per_token_logps" in inputs


def scores_kept(inputs) -> TeacherScores:
    """The teacher's scores a deferred batch kept."""
    return TeacherScores(**{field: inputs.get(key) for key, field in DEFERRED_SCORES.items()})
