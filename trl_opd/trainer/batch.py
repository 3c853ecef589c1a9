"""The hand-off from generation to the loss: what OPD adds to (or changes in) the batch GRPO's generation returns.

GRPO's `_generate_and_score_completions` returns a dict of tensors that its trainer splits into micro-batches by rows
and hands to `_compute_loss`; OPDTrainer's `_signal` adds the keys below, and its loss reads them. B is the
generation batch's rows on this process, T the completion's width, k `opd_topk`, H the teacher's hidden size.
tests/test_trainer.py checks that a batch holds no key of OPD's that this table does not list.
"""

from __future__ import annotations

OPD_KEYS = {
    # the tokens to distil, on every path
    "action_mask": "(B, T) 1 where the student sampled the token and it is distilled (`multiturn.action_mask`)",
    "sampled_mask": "(B, T) cross-tokenizer teacher: every sampled token, aligned or not (`trl-opd check`)",
    # the teacher's signal, formed at generation
    "reward_advantages": "(B,) with rewards: GRPO's reward advantages, before they are joined with the teacher's",
    "teacher_advantages": "(B, T) with `opd_reward_combination: loss`: the second objective's advantages",
    "student_prefix_shift": "(B, T) byte credit: the sampling policy's side of the credit (`teachers.byte_credit`)",
    # the teacher's scores, kept where the loss forward forms the advantages (`advantages.defer_advantages`)
    "teacher_per_token_logps": "(B, T) log pi_T of each sampled token",
    "teacher_is_top1": "(B, T) bool: the sampled token is the teacher's most likely one",
    "teacher_entropy": "(B, T) the teacher's entropy at each position, where its source returns it",
    "teacher_chunk_ends": "(B, T) bool, cross-tokenizer teacher: the last student token of each aligned chunk",
    "opd_table_row": "(B,) each row's place in GRPO's completions table",
    # the teacher's side of the dense term (`dense.DenseTerm.keep`)
    "teacher_hidden_states": "(B, T, H) 'full': the teacher's final states before each sampled token",
    "teacher_route": "(B,) routed 'full': which teacher's head projects each row",
    "teacher_topk_ids": "(B, T, k) 'topk': the teacher's top-k token ids",
    "teacher_topk_logps": "(B, T, k) 'topk': their log-probs",
}

# GRPO's keys that OPD sets: to the teacher's signal, or where GRPO left them unset
GRPO_KEYS_SET = {
    "advantages": "(B, T) the teacher's advantages (alone or summed with the rewards'), NaN until the loss forward "
                  "forms them where it does; GRPO's own (B,) reward advantages with `opd_reward_combination: loss`",
    "tool_mask": "(B, T) the action mask: GRPO's loss trains only these tokens",
    "num_items_in_batch": "() the action tokens on all processes, GRPO's loss normalisation",
    "old_per_token_logps": "(B, T) the sampling policy's log-probs, where the advantage needs them and GRPO skipped "
                           "them",
}
