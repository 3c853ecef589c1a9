"""The student's own frozen starting point as the teacher: GRPO's reference model, or a PEFT student's base model.

With the reference as teacher, the student starts equal to its teacher, so `opd/reverse_kl` must be 0 at the first
step: a cheap check that rollout, old log-probs, teacher log-probs and the update are aligned. With the base model of
a PEFT student, it is self-distillation with no second copy of the weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .base import SourceSupport, TeacherScores

SUPPORT = SourceSupport(
    name="reference",
    chooses=("ref_as_teacher",),
    option="ref_as_teacher",
    estimators=("sampled",),
    off_trainer=False,
    own_tokenizer=False,
    teacher_temperature=False,
    not_loaded="ref_as_teacher's teacher is GRPO's reference copy of the student (model_init_kwargs sets it)",
    default_estimator="sampled",
    returns="log-probs of the sampled tokens",
    describe=lambda args: "the student's own reference model (ref_as_teacher)",
)

class ReferenceTeacher:
    """Scores with `logps_fn(input_ids, attention_mask, logits_to_keep) -> (B, T)`, which the trainer binds to its
    reference model or to its student with the adapter switched off."""

    def __init__(self, logps_fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]):
        self.logps_fn = logps_fn

    @torch.no_grad()
    def score(self, prompt_ids, prompt_mask, completion_ids, completion_mask) -> TeacherScores:
        logps = self.logps_fn(
            torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([prompt_mask, completion_mask], dim=1),
            completion_ids.size(1),
        )
        return TeacherScores(logps=logps.float())
