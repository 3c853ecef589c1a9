"""The dense terms of the 'topk' and 'full' estimators, added to GRPO's policy loss on the same student forward.

The student's final hidden states are taken from its one loss forward (a hook on the backbone); the teacher's side
was kept from its single scoring pass (hidden states for 'full', top-k ids and log-probs for 'topk').
"""

from __future__ import annotations

import torch
from accelerate.utils import is_peft_model

from .loss import dense_reverse_kl, dense_topk_reverse_kl
from .teachers.base import TeacherScores


class DenseLossMixin:
    """Mixed into OPDTrainer before GRPOTrainer; `_policy_loss` is the trainer's."""

    @staticmethod
    def _keep_dense_inputs(output, scores: TeacherScores) -> None:
        if scores.hidden is not None:
            output["teacher_hidden_states"] = scores.hidden  # (B, T, H_teacher), for the full estimator's term
        if scores.topk_ids is not None:
            output["teacher_topk_ids"] = scores.topk_ids  # (B, T, k), for the topk estimator's term
            output["teacher_topk_logps"] = scores.topk_logps  # (B, T, k)

    def _dense_and_policy_loss(self, model, inputs):
        if "teacher_hidden_states" not in inputs and "teacher_topk_ids" not in inputs:
            return self._policy_loss(model, inputs)
        student = self._student_causal_lm()
        hidden = []
        hook = student.base_model.register_forward_hook(lambda m, a, out: hidden.append(out.last_hidden_state))
        try:
            loss = self._policy_loss(model, inputs)
        finally:
            hook.remove()
        return loss + self.args.opd_dense_coef * self._dense_loss(inputs, hidden[0], student)

    def _student_causal_lm(self):
        unwrapped = self.accelerator.unwrap_model(self.model)
        return unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped

    def _dense_loss(self, inputs, student_hidden, student) -> torch.Tensor:
        """The reverse KL over the vocabulary ('full': exact; 'topk': the teacher's top-k plus a tail bucket) at
        every completion position, normalised like GRPO's 'dapo' loss (by the generation batch's token count), so it
        adds to the policy term on the same scale."""
        mode = "train" if self.model.training else "eval"
        num_completion = inputs["completion_ids"].size(1)
        mask = inputs["action_mask"]  # the tokens the student sampled (see multiturn.action_mask)
        student_hidden, student_head = student_hidden[:, -num_completion - 1 : -1], student.get_output_embeddings()
        if "teacher_topk_ids" in inputs:
            name = "opd/reverse_kl_topk"
            per_token = dense_topk_reverse_kl(
                student_hidden, student_head.weight, inputs["teacher_topk_ids"], inputs["teacher_topk_logps"], mask,
                student_head_bias=student_head.bias,
            )  # (B, T)
        else:
            name, teacher_head = "opd/reverse_kl_dense", self.teacher.causal_lm.get_output_embeddings()
            per_token = dense_reverse_kl(
                student_hidden, student_head.weight, inputs["teacher_hidden_states"], teacher_head.weight, mask,
                student_head_bias=student_head.bias, teacher_head_bias=teacher_head.bias,
            )  # (B, T)
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        totals = self.accelerator.reduce(torch.stack([per_token.detach().sum(), mask.sum().float()]), "sum")
        self._metrics[mode][name].append((totals[0] / totals[1].clamp(min=1.0)).item())
        return per_token.sum() / normalizer

