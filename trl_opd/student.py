"""The student's side of the loss: its causal LM, its output head at the sampling temperature, and, where GRPO's fused
LM head would project every position, its log-probs projected at the completion positions only.

GRPO's loss forward scores the completion through TRL's fused LM head, which on Triton devices projects only the
completion positions; elsewhere (a CPU) it projects every position of the sequence, prompt included, with gradient,
so that the vocabulary projection and its backward cost (prompt + completion) / completion times what the loss reads.
There, the loss forward's log-probs come instead from the backbone's final hidden states at the completion positions,
through the student's head in tiles with gradient (`heads.head_token_logps`), and the entropy GRPO logs from one
no-grad projection of the same positions: the same values, to round-off, at the completion's share of the cost.
"""

from __future__ import annotations

from contextlib import contextmanager

from accelerate.utils import is_peft_model

from .heads import OutputHead, head_token_logps, head_token_stats
from .metrics import wrapped_logps_call

# inputs that GRPO's loss forward passes to a vision-language student: those forwards are left to GRPO
MULTIMODAL_INPUTS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "token_type_ids",
                     "mm_token_type_ids")


class StudentMixin:
    """Mixed into OPDTrainer before GRPOTrainer. Reads GRPO's `accelerator`, `model`, `temperature`,
    `aux_loss_enabled` and `_entropy_bonus_enabled`."""

    def _student_head(self, student) -> OutputHead:
        """The student's LM head at the sampling temperature: the policy that sampled, as GRPO's log-probs are."""
        return OutputHead.of(student, temperature=self.temperature)

    def _student_causal_lm(self):
        unwrapped = self.accelerator.unwrap_model(self.model)
        return unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped

    def _compact_logps_apply(self, inputs) -> bool:
        """Whether the loss forward's log-probs are projected at the completion positions only: where GRPO's fused
        head projects every position (no Triton: a CPU), for a text-only student, and with no term that needs the
        entropy's gradient (an entropy bonus) or the MoE auxiliary loss from the forward."""
        return (self.accelerator.device.type == "cpu" and not self.aux_loss_enabled
                and not self._entropy_bonus_enabled and not any(key in inputs for key in MULTIMODAL_INPUTS))

    @contextmanager
    def _compact_student_logps(self, inputs):
        """Within the block, GRPO's student log-prob call is the compact one, where `_compact_logps_apply`."""
        if not self._compact_logps_apply(inputs):
            yield
            return
        with wrapped_logps_call(self, lambda original: self._completion_logps):
            yield

    def _completion_logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                          compute_entropy=False, compute_aux_loss=False, **multimodal):
        """GRPO's `_get_per_token_logps_and_entropies` for the student, projected at the last `logits_to_keep`
        positions with a token (the completion's; padding reads 0, as in GRPO's)."""
        student = self._student_causal_lm()
        with self.accelerator.autocast():
            hidden = student.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        hidden = hidden.last_hidden_state[:, -logits_to_keep - 1 : -1]
        ids, valid = input_ids[:, -logits_to_keep:], attention_mask[:, -logits_to_keep:].bool()
        head = self._student_head(student)
        logps = head_token_logps(hidden[valid], head, ids[valid, None])[:, 0]
        logps = logps.new_zeros(ids.shape).masked_scatter(valid, logps)
        entropy = None
        if compute_entropy:
            _, valid_entropy, _ = head_token_stats(hidden[valid].detach(), head, ids[valid])
            entropy = valid_entropy.new_zeros(ids.shape).masked_scatter(valid, valid_entropy)
        return logps, entropy, None
