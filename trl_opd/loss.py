"""The on-policy distillation math: pure tensor functions, keyword-only hyper-parameters, no trainer state.

Shapes: B sequences, T completion positions. `mask` is 1 on tokens the student sampled and 0 elsewhere (padding,
and later tool observations). References: on-policy distillation as in Agarwal et al. 2024
(https://arxiv.org/abs/2306.13649) and the per-token reverse-KL advantage of Lu & Thinking Machines 2025
(https://thinkingmachines.ai/blog/on-policy-distillation/).
"""

from __future__ import annotations

import math

import torch

# Logits per tile: 2^23 float32 values (32 MiB), e.g. 55 positions of a 151k vocabulary
TILE_ELEMENTS = 2**23
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


def dense_topk_reverse_kl(
    student_hidden: torch.Tensor,
    student_head_weight: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    teacher_topk_logps: torch.Tensor,
    mask: torch.Tensor,
    *,
    student_head_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`topk_reverse_kl` at each masked-in position, shape (B, T), from the student's final hidden states (B, T, H),
    its LM head, and the teacher's top-k token ids and log-probs (B, T, k). Masked positions are 0; the gradient
    flows to the student's hidden states and head only."""
    valid = mask.bool()
    student_logps = head_token_logps(
        student_hidden[valid], student_head_weight, teacher_topk_ids[valid], head_bias=student_head_bias
    )
    kl = topk_reverse_kl(student_logps, teacher_topk_logps[valid].to(student_logps.device))
    return kl.new_zeros(mask.shape).masked_scatter(valid, kl)


def topk_reverse_kl(student_topk_logps: torch.Tensor, teacher_topk_logps: torch.Tensor) -> torch.Tensor:
    """KL(pi_S || pi_T) over k + 1 outcomes: the teacher's top-k tokens one by one, every other token as one tail
    bucket. Inputs (..., k) are each model's log-probs of the teacher's top-k tokens; output (...).

    Merging tokens into a bucket can only lower a KL, so this is a lower bound on the full-vocabulary KL, equal to it
    when the tail's two distributions are proportional. A tail mass rounded to 0 counts as 1e-7.
    """
    student = torch.cat([student_topk_logps, _tail_logp(student_topk_logps)], dim=-1)
    teacher = torch.cat([teacher_topk_logps, _tail_logp(teacher_topk_logps)], dim=-1)
    return (student.exp() * (student - teacher)).sum(-1)


def _tail_logp(topk_logps: torch.Tensor) -> torch.Tensor:
    """log(1 - sum exp(topk_logps)), shape (..., 1), computed stably and floored at log(1e-7)."""
    covered = topk_logps.logsumexp(-1, keepdim=True).clamp(max=-1e-7)
    # log(1 - e^x): expm1 is exact near x = 0, log1p near x = -inf
    tail = torch.where(covered > -math.log(2), torch.log(-torch.expm1(covered)), torch.log1p(-covered.exp()))
    return tail.clamp(min=math.log(1e-7))


def head_topk_logps(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    *,
    k: int,
    head_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    tile_elements: int = TILE_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens and their log-probs at each position, (N, k) each, from final hidden states (N, H)
    and an LM head (V, H), without gradient. Positions are projected onto the vocabulary a tile at a time."""
    ids, logps = [], []
    with torch.no_grad():
        for h in hidden.split(_tile_rows(head_weight, tile_elements)):
            logits = torch.nn.functional.linear(h, head_weight, head_bias).float() / temperature
            values, indices = logits.log_softmax(-1).topk(k, dim=-1)
            ids.append(indices)
            logps.append(values)
    if not ids:
        return hidden.new_zeros(0, k, dtype=torch.long), hidden.new_zeros(0, k, dtype=torch.float32)
    return torch.cat(ids), torch.cat(logps)


def head_token_logps(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    head_bias: torch.Tensor | None = None,
    tile_elements: int = TILE_ELEMENTS,
) -> torch.Tensor:
    """Log-probs (N, k) of the token `ids` (N, k) at each position, from final hidden states (N, H) and an LM head
    (V, H), differentiable in both. Forward and backward project a tile of positions onto the vocabulary at a time
    (the backward recomputes the tile's logits), so no (N, V) tensor ever exists."""
    return _TokenLogProbs.apply(hidden, head_weight, head_bias, ids, _tile_rows(head_weight, tile_elements))


@torch.no_grad()
def head_token_logps_and_entropy(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    head_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    tile_elements: int = TILE_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of token `ids` (N,) and the entropy of the next-token distribution (N,) at each position, from final
    hidden states (N, H) and an LM head (V, H), logits divided by `temperature`; no grad, in tiles of positions."""
    logps = hidden.new_empty(ids.shape, dtype=torch.float32)
    entropy = hidden.new_empty(ids.shape, dtype=torch.float32)
    rows = _tile_rows(head_weight, tile_elements)
    for start in range(0, hidden.size(0), rows):
        tile = slice(start, start + rows)
        tile_logps = (torch.nn.functional.linear(hidden[tile], head_weight, head_bias).float() / temperature)
        tile_logps = tile_logps.log_softmax(-1)
        logps[tile] = tile_logps.gather(-1, ids[tile, None])[:, 0]
        entropy[tile] = -(tile_logps.exp() * tile_logps).sum(-1)
    return logps, entropy


def _tile_rows(head_weight: torch.Tensor, tile_elements: int) -> int:
    return max(1, tile_elements // head_weight.size(0))


class _TokenLogProbs(torch.autograd.Function):
    """`log_softmax(hidden @ W.T + b)[ids]` in tiles of positions; the backward recomputes each tile's softmax."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, rows):
        logps = hidden.new_empty(ids.shape, dtype=torch.float32)
        normalizers = hidden.new_empty(ids.size(0), dtype=torch.float32)
        for start in range(0, hidden.size(0), rows):
            tile = slice(start, start + rows)
            logits = torch.nn.functional.linear(hidden[tile], weight, bias).float()
            normalizers[tile] = logits.logsumexp(-1)
            logps[tile] = logits.gather(-1, ids[tile]) - normalizers[tile, None]
        ctx.save_for_backward(hidden, weight, bias, ids, normalizers)
        ctx.rows = rows
        return logps

    @staticmethod
    def backward(ctx, grad_logps):
        hidden, weight, bias, ids, normalizers = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        wants_bias = bias is not None and ctx.needs_input_grad[2]
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if wants_bias else None
        for start in range(0, hidden.size(0), ctx.rows):
            tile = slice(start, start + ctx.rows)
            grad = grad_logps[tile].float()
            # d/dlogits of sum_j g_j log p(ids_j) = onehot(ids) g - softmax * sum_j g_j, built in place
            grad_logits = torch.nn.functional.linear(hidden[tile], weight, bias).float()
            grad_logits.sub_(normalizers[tile, None]).exp_().mul_(-grad.sum(-1, keepdim=True))
            grad_logits.scatter_add_(-1, ids[tile], grad)
            if grad_hidden is not None:
                grad_hidden[tile] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.T, hidden[tile].float())
            if grad_bias is not None:
                grad_bias.add_(grad_logits.sum(0))
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
        )


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
