"""Held-out evaluation of how far the student is from the teacher, independent of the trainer's own metrics.

The student samples completions for fixed prompts (seeded), then both models score them. Three numbers come back:
`reverse_kl`, the same single-sample estimate the trainer logs as `opd/reverse_kl` (mean over sampled tokens of
log pi_S - log pi_T), `reverse_kl_exact`, the full-vocabulary KL(pi_S || pi_T) averaged over the visited states, and
`forward_kl_exact`, KL(pi_T || pi_S) at the same (student-visited) states.
The exact one builds (rows, tokens, vocab) logits one row at a time: meant for small models and evaluation sets.
Given `solutions` and an `accuracy_func` (a GRPO reward function such as `trl.rewards.accuracy_reward`), `accuracy`
scores the same samples.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from transformers import TrainerCallback


def _render(tokenizer, prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


_NOT_LOGGED = ("tokens", "train_seconds")


@torch.no_grad()
def heldout_reverse_kl(
    student, teacher, tokenizer, prompts: list, *, max_new_tokens: int = 32, samples_per_prompt: int = 1,
    seed: int = 0, temperature: float = 1.0, solutions: list[str] | None = None, accuracy_func=None,
    greedy_accuracy: bool = False,
) -> dict[str, float]:
    """Sample from `student` on `prompts` (text or chat messages) and measure KL(student || teacher) on the samples,
    and with `solutions` and `accuracy_func` the fraction of samples it scores right (`accuracy`); with
    `greedy_accuracy` also that of its greedy answers, one per prompt (`accuracy_greedy`: no sampling noise, so the
    steadier measure of a short evaluation set)."""
    was_training = student.training
    student.eval()
    device = next(student.parameters()).device
    texts = [_render(tokenizer, p) for p in prompts for _ in range(samples_per_prompt)]
    # as training tokenizes them: text prompts with the tokenizer's special tokens (a BOS), chat prompts as rendered
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left",
                      add_special_tokens=isinstance(prompts[0], str))
    batch = batch.to(device)
    stop_ids = stop_token_ids(student, tokenizer)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    sequences = student.generate(
        **batch, do_sample=True, temperature=temperature, top_k=0, top_p=1.0, repetition_penalty=1.0,
        max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, eos_token_id=stop_ids,
    )
    torch.random.set_rng_state(generator_state)
    prompt_len = batch["input_ids"].size(1)
    completion = sequences[:, prompt_len:]
    completion_mask = until_first_stop(completion, stop_ids)
    attention_mask = torch.cat([batch["attention_mask"], completion_mask.long()], 1)

    sampled_sum = exact_sum = forward_sum = count = 0.0
    keep = completion.size(1) + 1  # logits only at the states that predict the completion, none of the prompt's
    for row in range(sequences.size(0)):  # one row at a time bounds the (tokens, vocab) logits
        ids, mask = sequences[row : row + 1], attention_mask[row : row + 1]
        positions = completion_mask[row]
        student_logp = student(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits[0, :-1] / temperature
        student_logp = student_logp.float().log_softmax(-1)[positions]
        teacher_logp = teacher(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits[0, :-1]
        teacher_logp = teacher_logp.float().log_softmax(-1)[positions]
        tokens = completion[row][positions, None]
        sampled_sum += (student_logp.gather(-1, tokens) - teacher_logp.gather(-1, tokens)).sum().item()
        exact_sum += (student_logp.exp() * (student_logp - teacher_logp)).sum().item()
        forward_sum += (teacher_logp.exp() * (teacher_logp - student_logp)).sum().item()
        count += positions.sum().item()
    count = max(count, 1.0)
    metrics = {"reverse_kl": sampled_sum / count, "reverse_kl_exact": exact_sum / count,
               "forward_kl_exact": forward_sum / count, "tokens": count}
    if accuracy_func is not None:
        repeat = lambda values: [v for v in values for _ in range(samples_per_prompt)]  # noqa: E731 (one per sample)
        metrics["accuracy"] = _accuracy(tokenizer, completion, completion_mask, accuracy_func,
                                        prompts=repeat(prompts), solutions=repeat(solutions))
    if accuracy_func is not None and greedy_accuracy:
        first = slice(None, None, samples_per_prompt)  # one row per prompt
        greedy = student.generate(
            input_ids=batch["input_ids"][first], attention_mask=batch["attention_mask"][first], do_sample=False,
            temperature=None, top_k=None, top_p=None, repetition_penalty=1.0, max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=stop_ids,
        )[:, prompt_len:]
        metrics["accuracy_greedy"] = _accuracy(tokenizer, greedy, until_first_stop(greedy, stop_ids), accuracy_func,
                                               prompts=prompts, solutions=solutions)
    student.train(was_training)
    return metrics


@torch.no_grad()
def heldout_text_reverse_kl(
    student, tokenizer, teacher, teacher_tokenizer, prompts: list, *, max_new_tokens: int = 32, seed: int = 0,
    temperature: float = 1.0, batch_size: int = 16, solutions: list[str] | None = None, accuracy_func=None,
    greedy_accuracy: bool = False,
) -> dict[str, float]:
    """KL(student || teacher) on the student's samples for a teacher with any tokenizer, per character of sampled text.

    The student samples one completion per prompt (seeded); the teacher reads each prompt through its own chat
    template and scores the completion's text in its own tokens, as a cross-tokenizer teacher does in training
    (`CrossTokenizerTeacher`). `reverse_kl_per_char` is the sum over samples of log pi_S(text) - log pi_T(text)
    divided by their characters (a stop token counts as one): a single-sample estimate, comparable across
    tokenizers. `reverse_kl_per_sequence` is the mean per completion; `chunk_tokens` the student tokens per aligned
    chunk. With `solutions` and `accuracy_func`, `accuracy` of the same samples, and with `greedy_accuracy` that of
    the student's greedy answers (`accuracy_greedy`)."""
    from .teachers.cross import CrossTokenizerTeacher
    from .teachers.local import LocalTeacher

    was_training = student.training
    student.eval()
    device = next(student.parameters()).device
    stop_ids = stop_token_ids(student, tokenizer)
    cross = CrossTokenizerTeacher(LocalTeacher(teacher.eval(), batch_size=batch_size), student_tokenizer=tokenizer,
                                  teacher_tokenizer=teacher_tokenizer, stop_ids=stop_ids, credit="chunk")
    totals = {"kl": 0.0, "characters": 0.0, "sequences": 0.0, "tokens": 0.0, "chunks": 0.0, "unaligned": 0.0}
    completions, masks, greedy = [], [], []
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    for start in range(0, len(prompts), batch_size):
        rows = prompts[start : start + batch_size]
        batch = tokenizer([_render(tokenizer, p) for p in rows], return_tensors="pt", padding=True,
                          padding_side="left", add_special_tokens=isinstance(rows[0], str)).to(device)
        sequences = student.generate(
            **batch, do_sample=True, temperature=temperature, top_k=0, top_p=1.0, repetition_penalty=1.0,
            max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, eos_token_id=stop_ids,
        )
        completion = sequences[:, batch["input_ids"].size(1) :]
        completion_mask = until_first_stop(completion, stop_ids)
        attention_mask = torch.cat([batch["attention_mask"], completion_mask.long()], 1)
        logits = student(input_ids=sequences, attention_mask=attention_mask,
                         logits_to_keep=completion.size(1) + 1).logits[:, :-1].float() / temperature
        student_logps = logits.log_softmax(-1).gather(-1, completion[..., None])[..., 0]
        scores = cross.score(rows, completion, completion_mask.long(), completion_mask.long())
        aligned = scores.aligned
        totals["kl"] += (student_logps - scores.logps)[aligned].sum().item()
        totals["sequences"] += len(rows)
        totals["tokens"] += aligned.sum().item()
        totals["chunks"] += scores.text_chunk_ends.sum().item()
        totals["unaligned"] += (completion_mask & ~aligned).sum().item()
        for ids, keep in zip(completion, aligned, strict=True):
            kept = ids[keep].tolist()
            text = [token for token in kept if token not in stop_ids]
            totals["characters"] += len(b"".join(cross.student(text)).decode(errors="replace")) + len(kept) - len(text)
        completions.append(completion), masks.append(completion_mask)
        if greedy_accuracy and accuracy_func is not None:
            greedy.append(student.generate(
                **batch, do_sample=False, temperature=None, top_k=None, top_p=None, repetition_penalty=1.0,
                max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, eos_token_id=stop_ids,
            )[:, batch["input_ids"].size(1) :])
    torch.random.set_rng_state(generator_state)
    metrics = {"reverse_kl_per_char": totals["kl"] / max(totals["characters"], 1.0),
               "reverse_kl_per_sequence": totals["kl"] / max(totals["sequences"], 1.0),
               "chunk_tokens": totals["tokens"] / max(totals["chunks"], 1.0),
               "unaligned_token_fraction": totals["unaligned"] / max(totals["tokens"] + totals["unaligned"], 1.0),
               "characters": totals["characters"]}
    if accuracy_func is not None:
        metrics["accuracy"] = _accuracy(tokenizer, *_stacked(completions, masks, tokenizer.pad_token_id),
                                        accuracy_func, prompts=prompts, solutions=solutions)
    if greedy:
        masks = [until_first_stop(completion, stop_ids) for completion in greedy]
        metrics["accuracy_greedy"] = _accuracy(tokenizer, *_stacked(greedy, masks, tokenizer.pad_token_id),
                                               accuracy_func, prompts=prompts, solutions=solutions)
    student.train(was_training)
    return metrics


def _stacked(completions: list[torch.Tensor], masks: list[torch.Tensor], pad_id: int):
    """Batches of completions (and their masks) of different widths as one right-padded pair."""
    width = max(completion.size(1) for completion in completions)
    return (torch.cat([torch.nn.functional.pad(c, (0, width - c.size(1)), value=pad_id) for c in completions]),
            torch.cat([torch.nn.functional.pad(m, (0, width - m.size(1))) for m in masks]))


def _accuracy(tokenizer, completion, completion_mask, accuracy_func, *, prompts: list, solutions: list) -> float:
    """The mean of `accuracy_func` over the decoded completions, one per row of `prompts` and `solutions`; a None
    score (the function could not judge it) is skipped, as in training."""
    texts = tokenizer.batch_decode(completion.masked_fill(~completion_mask, tokenizer.pad_token_id),
                                   skip_special_tokens=True)
    chat = not isinstance(prompts[0], str)
    completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
    scores = accuracy_func(completions=completions, solution=solutions, prompts=prompts)
    scored = [s for s in scores if s is not None]
    return sum(scored) / len(scored) if scored else float("nan")


def until_first_stop(completion: torch.Tensor, stop_ids: list[int]) -> torch.Tensor:
    """(B, T) bool: True up to and including each row's first stop token; what `generate` appended after it (padding)
    is False."""
    stops = torch.isin(completion, torch.tensor(stop_ids, device=completion.device)).int()
    return (stops.cumsum(1) - stops) == 0


def stop_token_ids(model, tokenizer) -> list[int]:
    """The ids that end a completion, as GRPO's training counts them: the tokenizer's eos and the model's generation
    config's (chat models often stop on several, e.g. Qwen's `<|im_end|>` and `<|endoftext|>`)."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
    return list(dict.fromkeys([tokenizer.eos_token_id, *configured]))


class HeldoutReverseKLCallback(TrainerCallback):
    """Every `eval_every` optimizer steps (and before the first), `heldout_reverse_kl` of the student being trained,
    into `state.log_history` as `eval/reverse_kl`, `eval/reverse_kl_exact`, `eval/forward_kl_exact` (and
    `eval/accuracy`). Works with any
    Trainer, so that trainers without an evaluation of their own are measured alike.

    Single-process: the student generates with plain `generate`. `history` keeps (step, metrics) for scripts, with
    `train_seconds`: wall-clock time since training began, less the time spent in this callback. `initial`, where
    given, is the untrained student's metrics, measured once for a sweep whose runs all start from it (the same
    prompts and seed sample the same answers): recorded before the first step instead of measuring them again.
    """

    def __init__(self, teacher, tokenizer, prompts: list, *, eval_every: int, initial: dict | None = None, **kwargs):
        self.teacher, self.tokenizer, self.prompts = teacher, tokenizer, prompts
        self.eval_every, self.initial, self.kwargs = eval_every, initial, kwargs
        self.history: list[tuple[int, dict[str, float]]] = []
        self._start = self._eval_seconds = 0.0

    def _evaluate(self, step: int, model) -> dict[str, float]:
        begin = time.perf_counter()
        metrics = heldout_reverse_kl(model, self.teacher, self.tokenizer, self.prompts, **self.kwargs)
        metrics["train_seconds"] = begin - self._start - self._eval_seconds
        self._eval_seconds += time.perf_counter() - begin
        self.history.append((step, metrics))
        return metrics

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._start, self._eval_seconds = time.perf_counter(), 0.0
        if self.initial is None:
            self._evaluate(state.global_step, model)
        else:
            self.history.append((state.global_step, {**self.initial, "train_seconds": 0.0}))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.eval_every == 0:
            metrics = self._evaluate(state.global_step, model)
            state.log_history.append(
                {"step": state.global_step, **{f"eval/{k}": v for k, v in metrics.items() if k not in _NOT_LOGGED}}
            )


# held-out metrics a curve shows: its name -> (the trainer's log key, a plot label). First the accuracy, then every
# divergence a dense term logs (the exact one, or its top-k bound), then the sampled tokens' reverse KL, which every
# estimator logs; the plot draws the accuracy and the first divergence the run logged.
CURVE_METRICS = {
    "accuracy": ("eval_accuracy", "held-out accuracy"),
    **{f"{divergence}_{'exact' if term == 'dense' else 'topk'}":
       (f"eval_opd/{divergence}_{term}", f"held-out {label}, {'exact' if term == 'dense' else 'top-k bound'}")
       for term in ("dense", "topk")
       for divergence, label in (("reverse_kl", "KL(student || teacher)"), ("forward_kl", "KL(teacher || student)"),
                                 ("jsd", "JSD"))},
    "reverse_kl_sampled": ("eval_opd/reverse_kl", "held-out KL(student || teacher), sampled"),
}


def heldout_curve(log_history: list[dict]) -> list[dict]:
    """The trainer's evaluations as one row per evaluated step: `step` and whichever of `CURVE_METRICS` it logged."""
    return [{"step": entry["step"], **{name: entry[key] for name, (key, _) in CURVE_METRICS.items() if key in entry}}
            for entry in log_history if "eval_loss" in entry]


def write_heldout_curve(curve: list[dict], output_dir: str | Path) -> list[Path]:
    """`heldout_curve.json` in `output_dir` and, where matplotlib is installed, `heldout_curve.png`: held-out
    accuracy and the run's divergence per evaluation. Returns the files written."""
    output_dir = Path(output_dir)
    written = [output_dir / "heldout_curve.json"]
    written[0].write_text(json.dumps(curve, indent=1) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    panels = [(name, label) for name, (_, label) in CURVE_METRICS.items() if any(name in row for row in curve)][:2]
    if not panels:
        return written
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    for axis, (name, label) in zip(axes[0], panels, strict=True):
        rows = [row for row in curve if name in row]
        axis.plot([row["step"] for row in rows], [row[name] for row in rows], marker="o")
        axis.set(xlabel="step", ylabel=label)
        axis.grid(alpha=0.3)
        if name != "accuracy":
            axis.set_yscale("log")
    fig.tight_layout()
    fig.savefig(output_dir / "heldout_curve.png", dpi=100)
    plt.close(fig)
    return [*written, output_dir / "heldout_curve.png"]
