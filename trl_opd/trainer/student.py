"""The student's side of the loss, where GRPO's fused LM head would project every position: its log-probs projected at
the completion positions only (the trainer's `_student_causal_lm` and `_student_head` give the model and its head).

GRPO's loss forward scores the completion through TRL's fused LM head, which on Triton devices projects only the
completion positions; elsewhere (a CPU) it projects every position of the sequence, prompt included, with gradient,
so that the vocabulary projection and its backward cost (prompt + completion) / completion times what the loss reads.
There, the loss forward's log-probs come instead from the backbone's final hidden states at the completion positions,
through the student's head in tiles with gradient (`heads.head_token_logps`), and the entropy GRPO logs from one
no-grad projection of the same positions: the same values, to round-off, at the completion's share of the cost.
"""

from __future__ import annotations

from ..heads import OutputHead, head_token_logps, head_token_stats


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
