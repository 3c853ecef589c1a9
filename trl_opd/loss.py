"""The on-policy distillation math: pure tensor functions, keyword-only hyper-parameters, no trainer state.

Shapes: B sequences, T completion positions. `mask` is 1 on tokens the student sampled and 0 elsewhere (padding,
and later tool observations). References: on-policy distillation as in Agarwal et al. 2024
(https://arxiv.org/abs/2306.13649) and the per-token reverse-KL advantage of Lu & Thinking Machines 2025
(https://thinkingmachines.ai/blog/on-policy-distillation/).
"""

from __future__ import annotations

import math

import torch

# Order of the entries of `opd_metric_sums`, so the vector can be summed across processes in one reduction
_SUM_NAMES = ("tokens", "kl", "kl_sq", "teacher_logp", "student_logp", "advantage", "agreement", "entropy")


def opd_advantages(
    teacher_per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    mask: torch.Tensor,
    *,
    coef: float = 1.0,
    discount: float = 0.0,
) -> torch.Tensor:
    """Per-token advantages `A[t] = coef * (log pi_T(a_t|s_t) - log pi_old(a_t|s_t)) * mask[t]`, shape (B, T).

    With `discount` gamma > 0, `A[t]` is replaced by `sum_{k >= t} gamma^(k - t) A[k]` along the completion, then
    masked again so padding stays at zero. Positions where `mask` is 0 are exactly 0 even if the log-probs there are
    NaN or inf (padding is never scored).
    """
    mask = mask.bool()
    difference = torch.where(mask, teacher_per_token_logps - old_per_token_logps, 0.0)
    advantages = coef * difference
    if discount > 0.0:
        advantages = torch.where(mask, discounted_future_sum(advantages, gamma=discount), 0.0)
    return advantages


def discounted_future_sum(values: torch.Tensor, *, gamma: float) -> torch.Tensor:
    """`out[:, t] = sum_{k >= t} gamma^(k - t) values[:, k]` for a (B, T) tensor (a reverse scan over T)."""
    out = torch.empty_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in range(values.size(1) - 1, -1, -1):
        running = values[:, t] + gamma * running
        out[:, t] = running
    return out


def dense_reverse_kl(
    student_hidden: torch.Tensor,
    student_head_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_head_weight: torch.Tensor,
    mask: torch.Tensor,
    *,
    student_head_bias: torch.Tensor | None = None,
    teacher_head_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact KL(pi_S(.|s_t) || pi_T(.|s_t)) over the whole vocabulary at each masked-in position, shape (B, T).

    From the final hidden states (B, T, H_s) and (B, T, H_t) and each model's LM head, projected in tiles by TRL's
    chunked divergence kernel, so neither (positions, vocab) logits tensor exists whole. The gradient flows to the
    student's hidden states and head only. Masked positions are 0.
    """
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    valid = mask.bool()
    kl, _ = ChunkedDivergenceFunction.apply(
        student_hidden[valid], student_head_weight, student_head_bias,
        teacher_hidden[valid].to(student_hidden.device), teacher_head_weight, teacher_head_bias,
        1.0,  # beta 1: the reverse KL, KL(student || teacher)
        1.0,
    )
    # masked_scatter keeps the graph even when no position is valid
    return kl.new_zeros(mask.shape).masked_scatter(valid, kl)


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
) -> torch.Tensor:
    """Masked sums behind the `opd/*` metrics, as one float vector that can be summed across processes.

    Turn the (summed) vector into metrics with `opd_metrics_from_sums`. A missing `teacher_is_top1` or
    `teacher_entropy` contributes NaN, so the metric is absent rather than a misleading 0.
    """
    mask = mask.bool()

    def total(x: torch.Tensor | None) -> torch.Tensor:
        if x is None:
            return torch.tensor(math.nan, device=mask.device)
        return torch.where(mask, x.float(), 0.0).sum()

    kl = reverse_kl_per_token(teacher_per_token_logps, old_per_token_logps)
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
