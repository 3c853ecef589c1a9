"""The on-policy distillation math: pure tensor functions, keyword-only hyper-parameters, no trainer state.

Shapes: B sequences, T completion positions. `mask` is 1 on tokens the student sampled and 0 elsewhere (padding,
and later tool observations). References: on-policy distillation as in Agarwal et al. 2024
(https://arxiv.org/abs/2306.13649) and the per-token reverse-KL advantage of Lu & Thinking Machines 2025
(https://thinkingmachines.ai/blog/on-policy-distillation/).
"""

from __future__ import annotations

import math

import torch

from .heads import OutputHead, head_token_logps, tile_elements_for

# Order of the entries of `opd_metric_sums`, so the vector can be summed across processes in one reduction
_SUM_NAMES = ("tokens", "kl", "kl_sq", "teacher_logp", "student_logp", "advantage", "agreement", "entropy")


def opd_advantages(
    teacher_per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    mask: torch.Tensor,
    *,
    coef: float = 1.0,
    discount: float = 0.0,
    chunk_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token advantages `A[t] = coef * (log pi_T(a_t|s_t) - log pi_old(a_t|s_t)) * mask[t]`, shape (B, T).

    With `discount` gamma > 0, `A[t]` is replaced by the discounted sum of the advantages of this and every later
    action token, one factor of gamma per action: observations and template tokens between two turns are not steps
    of the student's and neither add a factor nor carry an advantage. Positions where `mask` is 0 are exactly 0 even
    if the log-probs there are NaN or inf (padding is never scored).

    With `chunk_ends` (a teacher with another tokenizer, see `TeacherScores`), the actions are chunks of tokens: a
    chunk's advantage is `coef * (log pi_T(chunk) - log pi_old(chunk))`, the teacher's chunk log-prob standing on
    its last token, and every token of the chunk gets it, since the chunk's log-prob, whose score-function gradient
    the objective takes, is the sum of its tokens'. The discount counts one step per chunk. With one chunk per token
    this is the per-token advantage exactly.
    """
    mask = mask.bool()
    difference = torch.where(mask, teacher_per_token_logps - old_per_token_logps, 0.0)
    if chunk_ends is None:
        advantages = coef * difference
        if discount > 0.0:
            advantages = torch.where(mask, discounted_future_sum(advantages, mask, gamma=discount), 0.0)
        return advantages
    steps = chunk_ends.bool() & mask
    rewards = coef * torch.where(steps, chunk_sums(difference, steps), 0.0)
    # between steps, discounted_future_sum holds the next step's value: each token gets its chunk's (discounted) sum
    return torch.where(mask, discounted_future_sum(rewards, steps, gamma=discount), 0.0)


def constant_negative_advantages(advantages: torch.Tensor, mask: torch.Tensor, *, sum_over_processes=None
                                 ) -> torch.Tensor:
    """The control of `OPDConfig.opd_constant_advantage`: `-mean|A|` at every position where `mask` is 1 and 0
    elsewhere, (B, T), the mean over the masked-in positions of all processes (`sum_over_processes` sums a tensor
    across them; None for one process). The advantages' scale is kept and their per-token information dropped."""
    mask = mask.bool()
    totals = torch.stack([torch.where(mask, advantages.abs(), 0.0).sum(), mask.sum().to(advantages.dtype)])
    if sum_over_processes is not None:
        totals = sum_over_processes(totals)
    magnitude = totals[0] / totals[1].clamp(min=1.0)
    return torch.where(mask, -magnitude, 0.0).to(advantages.dtype)


def chunk_sums(values: torch.Tensor, chunk_ends: torch.Tensor) -> torch.Tensor:
    """`values` (B, T) summed over each chunk of consecutive positions (a chunk ends where `chunk_ends` is True), the
    sum at every position of the chunk; positions after the last end form one more chunk."""
    chunk = chunk_ends.long().cumsum(1) - chunk_ends.long()  # chunks ended before each position
    sums = values.new_zeros(values.size(0), values.size(1) + 1).scatter_add_(1, chunk, values)
    return sums.gather(1, chunk)


def discounted_future_sum(values: torch.Tensor, mask: torch.Tensor, *, gamma: float) -> torch.Tensor:
    """`out[:, t] = sum_{k >= t, mask[k]} gamma^(n(t, k)) values[:, k]` for a (B, T) tensor, where n(t, k) counts the
    masked-in positions in (t, k]: a reverse scan over T that steps (and discounts) only at masked-in positions.
    Masked-out positions of `out` hold the sum from the next masked-in position on."""
    out = torch.empty_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in range(values.size(1) - 1, -1, -1):
        running = torch.where(mask[:, t], values[:, t] + gamma * running, running)
        out[:, t] = running
    return out


def dense_divergence(
    student_hidden: torch.Tensor,
    student_head: OutputHead,
    teacher_hidden: torch.Tensor,
    teacher_head: OutputHead,
    mask: torch.Tensor,
    *,
    beta: float = 1.0,
) -> torch.Tensor:
    """The exact divergence between pi_S(.|s_t) and pi_T(.|s_t) over the whole vocabulary at each masked-in position,
    shape (B, T); `beta` as TRL's: 1 the reverse KL(pi_S || pi_T), 0 the forward KL(pi_T || pi_S), in between the
    generalised Jensen-Shannon divergence `beta KL(pi_T || m) + (1 - beta) KL(pi_S || m)`,
    `m = beta pi_T + (1 - beta) pi_S`.

    From the final hidden states (B, T, H_s) and (B, T, H_t) and each model's output head (its scale, soft cap and
    temperature included), projected in tiles by TRL's chunked divergence kernel, so neither (positions, vocab) logits
    tensor exists whole. The gradient flows to the student's hidden states and head only. Masked positions are 0.
    The sum runs over the student's vocabulary: a teacher with extra rows is renormalised over the student's.
    """
    from trl.kernels.chunked_divergence import VOCAB_CHUNK_SIZE, ChunkedDivergenceFunction

    temperature, student_scale, teacher_scale = shared_temperature(student_head, teacher_head)
    valid = mask.bool()
    # each side's states in its head's dtype (a float32 head beside a bf16 backbone: `cast_lm_head_to_fp32`)
    student_valid = student_hidden[valid].to(student_head.weight.dtype)
    teacher_valid = teacher_hidden[valid].to(student_hidden.device, teacher_head.weight.dtype)
    # The kernel holds (positions, 32768) float32 tiles, up to 4096 positions at once, and on a CPU its torch fallback
    # several more of that size: it is called on as many positions as a tile of this device's size holds (4096 on an
    # accelerator, the kernel's own; 256 on a CPU), so the memory stays flat in the number of positions
    rows = max(1, tile_elements_for(student_hidden.device) // VOCAB_CHUNK_SIZE)
    parts = [
        ChunkedDivergenceFunction.apply(
            student_valid[start : start + rows], student_head.weight, student_head.bias,
            teacher_valid[start : start + rows], teacher_head.weight, teacher_head.bias,
            float(beta), temperature, student_scale, student_head.softcap, teacher_scale, teacher_head.softcap,
        )[0]
        for start in range(0, max(student_valid.size(0), 1), rows)  # one call even with no position (the graph)
    ]
    divergence = torch.cat(parts)
    # masked_scatter keeps the graph even when no position is valid
    return divergence.new_zeros(mask.shape).masked_scatter(valid, divergence)


def dense_reverse_kl(student_hidden, student_head, teacher_hidden, teacher_head, mask) -> torch.Tensor:
    """`dense_divergence` with beta 1: the exact KL(pi_S || pi_T) at each masked-in position, (B, T)."""
    return dense_divergence(student_hidden, student_head, teacher_hidden, teacher_head, mask, beta=1.0)


def divergence_name(beta: float) -> str:
    """The metric name of the divergence `beta` selects (TRL's meaning)."""
    return "reverse_kl" if beta == 1.0 else "forward_kl" if beta == 0.0 else "jsd"


def shared_temperature(student: OutputHead, teacher: OutputHead) -> tuple[float, float, float]:
    """(temperature, student scale, teacher scale) for a kernel that divides both sides by one temperature.

    Without a soft cap, `scale * x / T` equals `(scale * T' / T) * x / T'`, so one side's temperature folds into its
    scale; a soft cap applies the temperature after the tanh, so a soft-capped side keeps the kernel's temperature.
    """
    if student.temperature == teacher.temperature:
        return student.temperature, student.scale, teacher.scale
    if teacher.softcap is None:
        return student.temperature, student.scale, teacher.scale * student.temperature / teacher.temperature
    if student.softcap is None:
        return teacher.temperature, student.scale * teacher.temperature / student.temperature, teacher.scale
    raise ValueError(
        "The full-vocabulary term cannot divide two soft-capped models' logits by different temperatures (student "
        f"{student.temperature}, teacher {teacher.temperature}). Set teacher_temperature equal to temperature, or use "
        "opd_estimator='topk'."
    )


def dense_topk_divergence(
    student_hidden: torch.Tensor,
    student_head: OutputHead,
    teacher_topk_ids: torch.Tensor,
    teacher_topk_logps: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float = 1.0,
    with_mass: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`topk_divergence` at each masked-in position, shape (B, T), from the student's final hidden states (B, T, H),
    its output head, and the teacher's top-k token ids and log-probs (B, T, k). Masked positions are 0; the gradient
    flows to the student's hidden states and head only. With `with_mass`, also how much of each distribution the
    top-k term sees at each masked-in position: the student's and the teacher's probability on the teacher's top-k
    ids, (2, positions), without gradient (the rest is the tail bucket)."""
    valid = mask.bool()
    student_logps = head_token_logps(student_hidden[valid], student_head, teacher_topk_ids[valid])
    teacher_logps = teacher_topk_logps[valid].to(student_logps.device)
    divergence = topk_divergence(student_logps, teacher_logps, beta=beta)
    divergence = divergence.new_zeros(mask.shape).masked_scatter(valid, divergence)
    if not with_mass:
        return divergence
    mass = torch.stack([student_logps.detach().float().logsumexp(-1), teacher_logps.float().logsumexp(-1)]).exp()
    return divergence, mass


def dense_topk_reverse_kl(student_hidden, student_head, teacher_topk_ids, teacher_topk_logps, mask) -> torch.Tensor:
    """`dense_topk_divergence` with beta 1, (B, T)."""
    return dense_topk_divergence(student_hidden, student_head, teacher_topk_ids, teacher_topk_logps, mask, beta=1.0)


def topk_divergence(student_topk_logps: torch.Tensor, teacher_topk_logps: torch.Tensor, *,
                    beta: float = 1.0) -> torch.Tensor:
    """The divergence `beta` selects (as in `dense_divergence`) over k + 1 outcomes: the teacher's top-k tokens one
    by one, every other token as one tail bucket. Inputs (..., k) are each model's log-probs of the teacher's top-k
    tokens; output (...).

    Merging tokens into a bucket can only lower an f-divergence (KL and JSD alike), so this is a lower bound on the
    full-vocabulary one, equal to it when the tail's two distributions are proportional. A tail mass rounded to 0
    counts as 1e-7.
    """
    student = torch.cat([student_topk_logps, _tail_logp(student_topk_logps)], dim=-1)
    teacher = torch.cat([teacher_topk_logps, _tail_logp(teacher_topk_logps)], dim=-1)
    if beta == 1.0:
        return (student.exp() * (student - teacher)).sum(-1)
    if beta == 0.0:
        return (teacher.exp() * (teacher - student)).sum(-1)
    mixture = torch.logaddexp(student + math.log(1 - beta), teacher + math.log(beta))
    return (beta * teacher.exp() * (teacher - mixture) + (1 - beta) * student.exp() * (student - mixture)).sum(-1)


def topk_reverse_kl(student_topk_logps: torch.Tensor, teacher_topk_logps: torch.Tensor) -> torch.Tensor:
    """KL(pi_S || pi_T) over the teacher's top-k tokens and one tail bucket (`topk_divergence` with beta 1)."""
    return topk_divergence(student_topk_logps, teacher_topk_logps, beta=1.0)


def _tail_logp(topk_logps: torch.Tensor) -> torch.Tensor:
    """log(1 - sum exp(topk_logps)), shape (..., 1), computed stably and floored at log(1e-7)."""
    covered = topk_logps.logsumexp(-1, keepdim=True).clamp(max=-1e-7)
    # log(1 - e^x): expm1 is exact near x = 0, log1p near x = -inf
    tail = torch.where(covered > -math.log(2), torch.log(-torch.expm1(covered)), torch.log1p(-covered.exp()))
    return tail.clamp(min=math.log(1e-7))


def reverse_kl_per_token(teacher_per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor) -> torch.Tensor:
    """Single-sample estimate of KL(pi_old || pi_T) at each sampled token: `log pi_old(a_t) - log pi_T(a_t)`."""
    return old_per_token_logps - teacher_per_token_logps


@torch.no_grad()
def opd_metric_sums(
    *,
    teacher_per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    teacher_is_top1: torch.Tensor | None = None,
    teacher_entropy: torch.Tensor | None = None,
    chunk_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked sums behind the `opd/*` metrics, as one float vector that can be summed across processes.

    Turn the (summed) vector into metrics with `opd_metrics_from_sums`. A missing `teacher_is_top1` or
    `teacher_entropy` contributes NaN, so the metric is absent rather than a misleading 0. With `chunk_ends` (see
    `opd_advantages`), each token counts an equal share of its chunk's teacher log-prob and reverse-KL estimate, so
    the means stay per student token and their sums per completion are the chunks' sums.
    """
    mask = mask.bool()
    kl = reverse_kl_per_token(teacher_per_token_logps, old_per_token_logps)
    if chunk_ends is not None:
        steps = chunk_ends.bool() & mask
        size = chunk_sums(mask.float(), steps).clamp(min=1.0)
        teacher_per_token_logps = chunk_sums(torch.where(mask, teacher_per_token_logps, 0.0), steps) / size
        kl = -chunk_sums(torch.where(mask, -kl, 0.0), steps) / size

    def total(x: torch.Tensor | None) -> torch.Tensor:
        if x is None:
            return torch.tensor(math.nan, device=mask.device)
        return torch.where(mask, x.float(), 0.0).sum()

    sums = [
        mask.sum().float(),
        total(kl),
        total(kl * kl),
        total(teacher_per_token_logps),
        total(old_per_token_logps),
        total(advantages),
        total(teacher_is_top1),
        total(teacher_entropy),
    ]
    return torch.stack(sums)


def opd_metrics_from_sums(sums: torch.Tensor) -> dict[str, float]:
    """Means (and the KL's standard deviation over tokens) from `opd_metric_sums`. Empty when no token counted."""
    values = dict(zip(_SUM_NAMES, sums.tolist(), strict=True))
    n = values.pop("tokens")
    if n == 0:
        return {}
    means = {name: value / n for name, value in values.items()}
    metrics = {
        "opd/reverse_kl": means["kl"],
        "opd/reverse_kl_std": math.sqrt(max(means["kl_sq"] - means["kl"] ** 2, 0.0)),
        "opd/teacher_logp": means["teacher_logp"],
        "opd/student_logp": means["student_logp"],
        "opd/advantage_mean": means["advantage"],
        "opd/teacher_agreement": means["agreement"],
        "opd/teacher_entropy": means["entropy"],
    }
    return {name: value for name, value in metrics.items() if not math.isnan(value)}


# GRPO's loss types (TRL 1.16's `_compute_loss`), each with how it sums a per-token term into a micro-batch's loss
LOSS_TYPES = ("grpo", "sapo", "bnpo", "dr_grpo", "luspo", "dapo", "cispo", "vespo")


def aggregate_as_loss_type(per_token: torch.Tensor, mask: torch.Tensor, *, loss_type: str, accumulation: float,
                           max_completion_length: int, num_items_in_batch: torch.Tensor | None = None,
                           num_processes: int = 1, micro_steps_per_generation: float = 1.0) -> torch.Tensor:
    """`per_token` (B, T), 0 off `mask`, summed into a micro-batch's loss as GRPO's `loss_type` sums its policy term,
    so that a term added to GRPO's loss is on its scale whichever the type:

    - 'grpo', 'sapo': each sequence's token mean, then their mean, over `accumulation` (the gradient accumulation
      steps in training, 1 in evaluation);
    - 'bnpo': the micro-batch's token mean, over `accumulation`;
    - 'dr_grpo': the sum over sequences times `max_completion_length`, over `accumulation`;
    - 'luspo': each sequence's sum, then their mean, over `accumulation`;
    - 'dapo', 'cispo', 'vespo': the sum over the generation batch's tokens on one process (GRPO's
      `num_items_in_batch`, all processes' tokens, over `num_processes`), times `accumulation /
      micro_steps_per_generation` (the share of a generation batch one optimizer step trains on).
    """
    if loss_type in ("grpo", "sapo"):
        return (per_token.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    if loss_type == "bnpo":
        return per_token.sum() / mask.sum().clamp(min=1.0) / accumulation
    if loss_type == "dr_grpo":
        return per_token.sum() / (per_token.size(0) * max_completion_length) / accumulation
    if loss_type == "luspo":
        return per_token.sum(-1).mean() / accumulation
    if loss_type in ("dapo", "cispo", "vespo"):
        if num_items_in_batch is None:
            raise ValueError(f"loss_type {loss_type!r} sums over the generation batch's tokens: num_items_in_batch "
                             "(GRPO's count of them) is needed")
        normalizer = num_items_in_batch.clamp(min=1.0) / num_processes * accumulation / micro_steps_per_generation
        return per_token.sum() / normalizer
    raise ValueError(f"Unknown loss_type {loss_type!r}: trl_opd sums its terms as one of {', '.join(LOSS_TYPES)}")
