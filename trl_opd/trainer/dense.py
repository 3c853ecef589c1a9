"""The dense terms of the 'topk' and 'full' estimators, added to GRPO's policy loss on the same student forward.

The student's final hidden states are taken from its one loss forward (a hook on the backbone); the teacher's side
was kept from its single scoring pass (hidden states for 'full', top-k ids and log-probs for 'topk').

With a dense term alone (`opd_coef` 0, no reward functions, no KL or entropy term), GRPO's policy loss is exactly 0:
its vocabulary projection, log-softmax and backward would be spent on nothing. Then the student's forward stops at
the hidden states, the dense term is the whole loss, and the metrics that GRPO's forward would have given (the
sampled tokens' log-probs, the entropy) come from one no-grad projection in tiles.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch.distributed.tensor import DTensor

from ..heads import OutputHead
from ..loss import dense_divergence, dense_topk_divergence, divergence_name
from ..teachers.base import TeacherScores
from .metrics import OPDMetrics


class _ForwardOnly:
    """Calls `module.forward` without `module`'s hooks: for a call inside the forward that already ran them."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return self.module.forward(*args, **kwargs)


def has_dense_term(inputs) -> bool:
    """The batch kept the teacher's side of a dense term (`DenseTerm.keep`)."""
    return "teacher_hidden_states" in inputs or "teacher_topk_ids" in inputs


class DenseTerm:
    """The dense term of the 'topk' and 'full' estimators: the teacher's side kept from its scoring pass, the
    divergence over the vocabulary at every completion position, and its metrics.

    `teacher` is the scorer (its output heads project the kept hidden states), `is_student_parameter(weight)` tells a
    self-teacher's head (the student's own parameter) from a teacher's, and `metrics` gets the term's sums."""

    def __init__(self, teacher, *, beta: float, is_student_parameter: Callable[[torch.Tensor], bool],
                 metrics: OPDMetrics):
        self.teacher, self.beta, self.metrics = teacher, beta, metrics
        self._is_student_parameter = is_student_parameter
        self._held: ExitStack | None = None  # open through a training step's loss and backward (`heads_held`)
        self._whole_heads: dict[int, OutputHead] = {}  # id(sharded weight) -> its head made whole, for the step

    @contextmanager
    def heads_held(self) -> Iterator[None]:
        """One training step, its loss and backward: a sharded teacher head, gathered on first use, stays whole."""
        with ExitStack() as self._held:
            self._whole_heads = {}
            try:
                yield
            finally:
                self._held, self._whole_heads = None, {}

    def _whole_teacher_heads(self) -> tuple[OutputHead, ...]:
        """The teacher's head for the full term (routed teachers: each one's, in `TeacherScores.hidden_route`'s
        order), gathered once per training step when sharded (ZeRO-3 partitions, FSDP2 shards) and held whole until
        its backward is done (TRL's divergence kernel would gather a ZeRO-3 head again for each call of at most 4096
        positions, forward and backward: some 120 GB of all-gathers a step for an 8B teacher at the flagship's batch).
        A head that is the student's own parameter (a self-teacher's) is left to the student's forward, which holds it
        whole, and its gradient reduction."""
        heads = getattr(self.teacher, "output_heads", None) or (self.teacher.output_head,)
        return tuple(self._whole(head) for head in heads)

    def _whole(self, head: OutputHead) -> OutputHead:
        sharded = hasattr(head.weight, "ds_id") or isinstance(head.weight, DTensor)
        if not sharded or self._is_student_parameter(head.weight):
            return head
        if self._held is None:  # outside a training step: ZeRO-3's kernel gathers on each call, FSDP2's shards here
            if not isinstance(head.weight, DTensor):
                return head
            with head.gathered() as whole:
                return whole
        if id(head.weight) not in self._whole_heads:  # one gather per step
            self._whole_heads[id(head.weight)] = self._held.enter_context(head.gathered())
        return self._whole_heads[id(head.weight)]

    def keep(self, output, scores: TeacherScores, mode: str) -> None:
        """The teacher's side of the term, from its scores, in the generation batch."""
        self.metrics.expect_dense_rows(mode, output["completion_ids"].size(0))
        if scores.hidden is not None:
            output["teacher_hidden_states"] = scores.hidden  # (B, T, H_teacher), for the full estimator's term
        if scores.hidden_route is not None:
            output["teacher_route"] = scores.hidden_route  # (B,) routed teachers: whose head projects each row
        if scores.topk_ids is not None:
            output["teacher_topk_ids"] = scores.topk_ids  # (B, T, k), for the topk estimator's term
            output["teacher_topk_logps"] = scores.topk_logps  # (B, T, k)

    def per_token(self, inputs, student_hidden, student_head: OutputHead, mode: str) -> torch.Tensor:
        """The divergence of `beta` (the reverse KL by default) over the vocabulary ('full': exact; 'topk': the
        teacher's top-k plus a tail bucket) at every completion position (B, T), 0 off the action mask; its metrics
        go to `metrics` as sums. `student_hidden` is the student's final hidden states over the whole sequence."""
        num_completion = inputs["completion_ids"].size(1)
        mask = inputs["action_mask"]  # the tokens the student sampled (see multiturn.action_mask)
        student_hidden = student_hidden[:, -num_completion - 1 : -1]
        beta = self.beta
        if "teacher_topk_ids" in inputs:
            per_token, mass = dense_topk_divergence(
                student_hidden, student_head, inputs["teacher_topk_ids"], inputs["teacher_topk_logps"], mask, beta=beta,
                with_mass=True,
            )  # (B, T), (2, positions): how much of each distribution the top-k term sees
            sums = {f"opd/{divergence_name(beta)}_topk": per_token.sum(), "opd/student_topk_mass": mass[0].sum(),
                    "opd/teacher_topk_mass": mass[1].sum()}
        else:
            # routed teachers: each head over its own rows (the others masked out), on every process alike
            route = inputs.get("teacher_route")
            teacher_hidden = inputs["teacher_hidden_states"]
            per_token = sum(  # routed states are padded to the widest teacher: each head reads its own width
                dense_divergence(student_hidden, student_head, teacher_hidden[..., : head.hidden_size], head,
                                 mask if route is None else mask.bool() & (route == number)[:, None], beta=beta)
                for number, head in enumerate(self._whole_teacher_heads())
            )  # (B, T)
            sums = {f"opd/{divergence_name(beta)}_dense": per_token.sum()}
        self.metrics.log_dense_sums(mode, sums, mask.sum(), rows=mask.size(0))
        return per_token
