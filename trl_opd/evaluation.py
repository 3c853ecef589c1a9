"""Held-out evaluation of how far the student is from the teacher, independent of the trainer's own metrics.

The student samples completions for fixed prompts (seeded), then both models score them. Two numbers come back:
`reverse_kl`, the same single-sample estimate the trainer logs as `opd/reverse_kl` (mean over sampled tokens of
log pi_S - log pi_T), and `reverse_kl_exact`, the full-vocabulary KL(pi_S || pi_T) averaged over the visited states.
The exact one builds (rows, tokens, vocab) logits one row at a time: meant for small models and evaluation sets.
"""

from __future__ import annotations

import torch
from transformers import TrainerCallback


def _render(tokenizer, prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


@torch.no_grad()
def heldout_reverse_kl(
    student, teacher, tokenizer, prompts: list, *, max_new_tokens: int = 32, samples_per_prompt: int = 1,
    seed: int = 0, temperature: float = 1.0,
) -> dict[str, float]:
    """Sample from `student` on `prompts` (text or chat messages) and measure KL(student || teacher) on the samples."""
    was_training = student.training
    student.eval()
    device = next(student.parameters()).device
    texts = [_render(tokenizer, p) for p in prompts for _ in range(samples_per_prompt)]
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    batch = batch.to(device)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    sequences = student.generate(
        **batch, do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.random.set_rng_state(generator_state)
    prompt_len = batch["input_ids"].size(1)
    completion = sequences[:, prompt_len:]
    # tokens after the first end-of-sequence are padding that generate() appended
    ended = (completion == tokenizer.eos_token_id).int().cumsum(1)
    completion_mask = (ended - (completion == tokenizer.eos_token_id).int()) == 0
    attention_mask = torch.cat([batch["attention_mask"], completion_mask.long()], 1)

    sampled_sum = exact_sum = count = 0.0
    for row in range(sequences.size(0)):  # one row at a time bounds the (tokens, vocab) logits
        ids, mask = sequences[row : row + 1], attention_mask[row : row + 1]
        positions = completion_mask[row]
        student_logp = (student(input_ids=ids, attention_mask=mask).logits[0, prompt_len - 1 : -1] / temperature)
        student_logp = student_logp.float().log_softmax(-1)[positions]
        teacher_logp = teacher(input_ids=ids, attention_mask=mask).logits[0, prompt_len - 1 : -1]
        teacher_logp = teacher_logp.float().log_softmax(-1)[positions]
        tokens = completion[row][positions, None]
        sampled_sum += (student_logp.gather(-1, tokens) - teacher_logp.gather(-1, tokens)).sum().item()
        exact_sum += (student_logp.exp() * (student_logp - teacher_logp)).sum().item()
        count += positions.sum().item()
    student.train(was_training)
    count = max(count, 1.0)
    return {"reverse_kl": sampled_sum / count, "reverse_kl_exact": exact_sum / count, "tokens": count}


class HeldoutReverseKLCallback(TrainerCallback):
    """Every `eval_every` optimizer steps (and before the first), log `eval/reverse_kl` and `eval/reverse_kl_exact`.

    Single-process: the student generates with plain `generate`. `history` keeps (step, metrics) for scripts.
    """

    def __init__(self, teacher, tokenizer, prompts: list, *, eval_every: int, **kwargs):
        self.teacher, self.tokenizer, self.prompts = teacher, tokenizer, prompts
        self.eval_every, self.kwargs = eval_every, kwargs
        self.history: list[tuple[int, dict[str, float]]] = []

    def _evaluate(self, step: int, model) -> dict[str, float]:
        metrics = heldout_reverse_kl(model, self.teacher, self.tokenizer, self.prompts, **self.kwargs)
        self.history.append((step, metrics))
        return metrics

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._evaluate(state.global_step, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.eval_every == 0:
            metrics = self._evaluate(state.global_step, model)
            state.log_history.append(
                {"step": state.global_step, **{f"eval/{k}": v for k, v in metrics.items() if k != "tokens"}}
            )
