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

from contextlib import contextmanager

import torch

from .loss import opd_advantages
from .metrics import wrapped_logps_call
from .teachers.base import TeacherScores

# The teacher's per-token scores a deferred batch keeps, by batch key and TeacherScores field
DEFERRED_SCORES = {"teacher_per_token_logps": "logps", "teacher_is_top1": "is_top1", "teacher_entropy": "entropy",
                   "teacher_chunk_ends": "chunk_ends"}


class AdvantagesMixin:
    """Mixed into OPDTrainer before GRPOTrainer. Reads GRPO's `args`, `accelerator` and `reward_funcs`, and calls the
    methods declared at the end, which OPDTrainer's other bases provide."""

    def _set_advantages(self, inputs, scores: TeacherScores, old_per_token_logps) -> torch.Tensor:
        """The teacher's advantages `opd_coef * (log pi_T - log pi_old)` (B, T), put where GRPO's loss reads them:
        alone, summed with the rewards' (B,), or beside them for a second objective."""
        mask = inputs["action_mask"]
        teacher_advantages = opd_advantages(
            scores.logps, old_per_token_logps, mask, coef=self.args.opd_coef, discount=self.args.kl_discount_factor,
            chunk_ends=scores.chunk_ends,
        )  # (B, T)
        if not self.reward_funcs:
            inputs["advantages"] = teacher_advantages
        elif self.args.opd_reward_combination == "advantage":
            reward_advantages = inputs["reward_advantages"][:, None] * mask  # (B, 1) -> (B, T)
            inputs["advantages"] = reward_advantages + self.args.opd_loss_coef * teacher_advantages
        else:
            inputs["teacher_advantages"] = teacher_advantages
        return teacher_advantages

    def _advantages_in_loss_forward(self, output) -> bool:
        """Whether the batch's advantages are formed in the loss forward: GRPO computed no old log-probs (one update
        per generation batch, no vLLM importance sampling; its loss then takes the forward's own, detached) and the
        teacher's signal needs nothing else of the sampling policy (the byte credit needs its final states)."""
        return output.get("old_per_token_logps") is None and not self.args.byte_credit

    def _defer_advantages(self, output, scores: TeacherScores) -> None:
        """Keep the teacher's per-token scores in the batch and put NaN where GRPO's loss reads the advantages, until
        the loss forward forms them (`_use_loss_forward_logps`)."""
        for key, field in DEFERRED_SCORES.items():
            if getattr(scores, field) is not None:
                output[key] = getattr(scores, field)
        unformed = torch.full_like(scores.logps, float("nan"))
        if self.reward_funcs and self.args.opd_reward_combination == "loss":
            output["teacher_advantages"] = unformed  # GRPO's own reward advantages stay where they are
        else:
            output["advantages"] = unformed
        # where each row's advantage goes in GRPO's completions table, which holds the gathered generation batch
        rows = output["completion_ids"].size(0)
        output["opd_table_row"] = self._table_row_index(rows)
        self._expect_deferred_rows(rows, rows * self.accelerator.num_processes)

    @contextmanager
    def _observe_loss_forward_logps(self, inputs):
        """Within the block, a deferred micro-batch's advantages and metrics are formed from the loss forward's
        log-probs as soon as GRPO's log-prob call returns (its loss reads `advantages` after that call)."""
        if "teacher_per_token_logps" not in inputs:
            yield
            return

        def observe(compute):
            def observed(*args, **kwargs):
                result = compute(*args, **kwargs)
                self._use_loss_forward_logps(inputs, result[0].detach())
                return result

            return observed

        with wrapped_logps_call(self, observe):
            yield

    def _use_loss_forward_logps(self, inputs, old_per_token_logps) -> None:
        """A deferred micro-batch's advantages from the loss forward's detached log-probs, and its `opd/*` metrics."""
        scores = TeacherScores(**{field: inputs.get(key) for key, field in DEFERRED_SCORES.items()})
        self._check_finite(scores.logps, old_per_token_logps, inputs["action_mask"])
        teacher_advantages = self._set_advantages(inputs, scores, old_per_token_logps)
        self._log_deferred_metrics(inputs, scores, old_per_token_logps, teacher_advantages)

    # ------------------------------------------------------------------ provided by OPDTrainer and its other bases

    def _check_finite(self, teacher_logps, old_logps, mask) -> None:
        """Fail on every rank at once on a non-finite scored log-prob (`runs.RunSafetyMixin`)."""
        raise NotImplementedError

    def _expect_deferred_rows(self, rows: int, table_rows: int) -> None:
        """A deferred generation batch of `rows` rows (`table_rows` on all processes) begins
        (`metrics.OPDMetricsMixin`)."""
        raise NotImplementedError

    def _log_deferred_metrics(self, inputs, scores: TeacherScores, old_per_token_logps, advantages) -> None:
        """A deferred micro-batch's `opd/*` metrics and table rows (`metrics.OPDMetricsMixin`)."""
        raise NotImplementedError

    def _table_row_index(self, rows: int) -> torch.Tensor:
        """This process's rows' places in GRPO's completions table (`metrics.OPDMetricsMixin`)."""
        raise NotImplementedError
