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

from accelerate.utils import is_peft_model

from ..heads import OutputHead, head_token_logps, head_token_stats

# inputs that GRPO's loss forward passes to a vision-language student: those forwards are left to GRPO
MULTIMODAL_INPUTS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "token_type_ids",
                     "mm_token_type_ids")


def is_multimodal(inputs) -> bool:
    return any(key in inputs for key in MULTIMODAL_INPUTS)


def causal_lm(accelerator, model):
    """The student without its distributed and PEFT wrappers."""
    unwrapped = accelerator.unwrap_model(model)
    return unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped


def student_head(student, temperature: float) -> OutputHead:
    """The student's LM head at the sampling temperature: the policy that sampled, as GRPO's log-probs are."""
    return OutputHead.of(student, temperature=temperature)


def completion_logps(student, head: OutputHead, autocast, model, input_ids, attention_mask, logits_to_keep,
                     batch_size=None, compute_entropy=False, compute_aux_loss=False, **multimodal):
    """GRPO's `_get_per_token_logps_and_entropies` for the student (`model` is GRPO's, `student` its causal LM
    unwrapped), projected at the last `logits_to_keep` positions with a token (the completion's; padding reads 0, as
    in GRPO's)."""
    with autocast():
        hidden = student.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    hidden = hidden.last_hidden_state[:, -logits_to_keep - 1 : -1]
    ids, valid = input_ids[:, -logits_to_keep:], attention_mask[:, -logits_to_keep:].bool()
    logps = head_token_logps(hidden[valid], head, ids[valid, None])[:, 0]
    logps = logps.new_zeros(ids.shape).masked_scatter(valid, logps)
    entropy = None
    if compute_entropy:
        _, valid_entropy, _ = head_token_stats(hidden[valid].detach(), head, ids[valid])
        entropy = valid_entropy.new_zeros(ids.shape).masked_scatter(valid, valid_entropy)
    return logps, entropy, None
