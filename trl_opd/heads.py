"""How final hidden states become next-token log-probs: a model's LM head with its output transform, in tiles.

Some model families transform the projected logits before the softmax: a scale (Cohere's `logit_scale`, Granite's
`logits_scaling`, Falcon-H1's `lm_head_multiplier`) and a soft cap `c * tanh(z / c)` (Gemma 2 and 3). Every place in
this package that forms logits from hidden states goes through an `OutputHead`, so each log-prob is the one the model's
own forward gives, divided by a temperature: `z = softcap(scale * (h @ W.T + b)) / temperature`.

Under DeepSpeed ZeRO-3 a head's weights are partitioned (each rank holds a slice, the tensor itself is empty) except
inside a forward of their model; under FSDP2 they are `DTensor` shards outside it. Every function here gathers them
where it projects (`OutputHead.gathered`, a no-op when they are whole), in the forward and again in a hand-written
backward, as TRL's chunked kernels do. A loss that trains a head must still run inside its model's forward (see
`dense.py`): there ZeRO-3 gathers the head on access, and FSDP2 has unsharded it, whole through the backward, so that
its gradient is accumulated and reduced.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch.distributed.tensor import DTensor
from trl.trainer.utils import maybe_gather_lm_head_ctx

# Logits per tile, by where the head is: on a CPU 2^23 float32 values (32 MiB, 55 positions of a 151k vocabulary,
# sized to its caches); on an accelerator 2^27 (512 MiB, 883 positions), where a tile is one kernel launch and 64 x
# 2048 completion tokens would otherwise take some 2,400 Python-level tiles
CPU_TILE_ELEMENTS = 2**23
ACCELERATOR_TILE_ELEMENTS = 2**27


def tile_elements_for(device: torch.device) -> int:
    """Logits per tile for a head whose weight is on `device`."""
    return CPU_TILE_ELEMENTS if torch.device(device).type == "cpu" else ACCELERATOR_TILE_ELEMENTS


@dataclass(frozen=True)
class OutputHead:
    """An LM head (V, H) and the transform its model applies to the logits, at a sampling temperature."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0

    @classmethod
    def of(cls, model, *, temperature: float = 1.0) -> OutputHead:
        """The head of a transformers causal LM (PEFT and wrappers removed by the caller), read from its config."""
        config = model.config.get_text_config()
        head = model.get_output_embeddings()
        return cls(head.weight, head.bias, logit_scale(config), getattr(config, "final_logit_softcapping", None),
                   temperature)

    @property
    def vocab_size(self) -> int:
        """Rows of the head, also while ZeRO-3 holds it partitioned (then `weight` is empty and `ds_shape` is whole)."""
        return getattr(self.weight, "ds_shape", self.weight.shape)[0]

    @property
    def hidden_size(self) -> int:
        """Columns of the head: the width of the hidden states it projects, also while ZeRO-3 partitions it."""
        return getattr(self.weight, "ds_shape", self.weight.shape)[-1]

    @contextmanager
    def gathered(self) -> Iterator[OutputHead]:
        """This head with `weight` and `bias` whole, for the context: ZeRO-3's partitioned parameters are gathered in
        place, FSDP2's `DTensor` shards all-gathered into a copy (no gradient reaches the shards through it: a head
        that is trained is read inside its model's forward), and whole ones are left as they are."""
        if isinstance(self.weight, DTensor):
            yield replace(self, weight=self.weight.detach().full_tensor(),
                          bias=None if self.bias is None else self.bias.detach().full_tensor())
            return
        with maybe_gather_lm_head_ctx(self.weight, self.bias):
            yield self

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Transformed float32 logits (N, V) of hidden states (N, H), read in the head's dtype (a float32 head beside
        a bf16 backbone, as `cast_lm_head_to_fp32` makes it, projects float32 states)."""
        return self.transform(torch.nn.functional.linear(hidden.to(self.weight.dtype), self.weight, self.bias).float())

    def transform(self, raw: torch.Tensor) -> torch.Tensor:
        z = raw * self.scale if self.scale != 1.0 else raw
        if self.softcap is not None:
            z = self.softcap * torch.tanh(z / self.softcap)
        return z / self.temperature if self.temperature != 1.0 else z

    def transform_grad(self, raw: torch.Tensor) -> torch.Tensor:
        """d transform / d raw, elementwise, for a hand-written backward."""
        factor = self.scale / self.temperature
        if self.softcap is None:
            return torch.full_like(raw, factor)
        return (1 - torch.tanh(raw * (self.scale / self.softcap)).square()).mul_(factor)

    def tile_rows(self, tile_elements: int | None = None) -> int:
        """Positions per tile so that one tile of logits holds about `tile_elements` values (by default, the size
        for the head's device)."""
        return max(1, (tile_elements or tile_elements_for(self.weight.device)) // self.vocab_size)


def logit_scale(text_config) -> float:
    """The multiplier a model applies to its logits before any soft cap (1.0 for most models)."""
    # `logit_scale` (Cohere) or `output_multiplier`; Falcon-H1 multiplies by `lm_head_multiplier`; Granite and
    # MiniCPM3 divide by `logits_scaling`, while HyperCLOVA X multiplies by it
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(text_config, name, None)
        if value is not None:
            return float(value)
    scaling = getattr(text_config, "logits_scaling", None)
    if scaling is not None:
        return float(scaling) if text_config.model_type == "hyperclovax" else 1.0 / scaling
    return 1.0


@torch.no_grad()
def head_topk_logps(
    hidden: torch.Tensor, head: OutputHead, *, k: int, vocab_size: int | None = None,
    tile_elements: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens and their log-probs at each position, (N, k) each, from final hidden states (N, H),
    without gradient. Positions are projected onto the vocabulary a tile at a time. With `vocab_size`, the tokens are
    chosen among the first `vocab_size` ids (those a smaller student can write), log-probs still over all rows."""
    ids, logps = [], []
    with head.gathered() as head:
        for h in hidden.split(head.tile_rows(tile_elements)):
            values, indices = head.logits(h).log_softmax(-1)[:, :vocab_size].topk(k, dim=-1)
            ids.append(indices)
            logps.append(values)
    if not ids:
        return hidden.new_zeros(0, k, dtype=torch.long), hidden.new_zeros(0, k, dtype=torch.float32)
    return torch.cat(ids), torch.cat(logps)


@torch.no_grad()
def head_set_logps(
    hidden: torch.Tensor, head: OutputHead, positions: list[int], id_sets: list[torch.Tensor], *,
    tile_elements: int | None = None,
) -> list[float]:
    """The log-probability of a set of tokens at a position, `log sum_{v in id_sets[q]} p(v | positions[q])`, for
    each query q, from final hidden states (N, H), without gradient. Each position asked about is projected once, a
    tile of positions at a time. Gathers the head (a collective under ZeRO-3) even with no query, so that every
    process calls it once per batch."""
    asked = sorted(set(positions))
    queries: dict[int, list[int]] = {}
    for q, position in enumerate(positions):
        queries.setdefault(position, []).append(q)
    out = hidden.new_zeros(len(positions), dtype=torch.float32)
    rows = head.tile_rows(tile_elements)
    with head.gathered() as head:
        for start in range(0, len(asked), rows):
            tile = asked[start : start + rows]
            logps = head.logits(hidden[torch.tensor(tile, device=hidden.device)]).log_softmax(-1)
            for position, position_logps in zip(tile, logps, strict=True):
                for q in queries[position]:
                    out[q] = position_logps[id_sets[q].to(logps.device)].logsumexp(0)
    return out.tolist()  # one device sync


def head_token_logps(
    hidden: torch.Tensor, head: OutputHead, ids: torch.Tensor, *, tile_elements: int | None = None
) -> torch.Tensor:
    """Log-probs (N, k) of the token `ids` (N, k) at each position, from final hidden states (N, H), differentiable in
    the hidden states and the head. Forward and backward project a tile of positions onto the vocabulary at a time
    (the backward recomputes the tile's logits), so no (N, V) tensor ever exists."""
    if isinstance(head.weight, DTensor) and head.weight.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            "A trained LM head held as FSDP2 shards: its gradient would not reach them. Read the head inside its "
            "model's forward, where FSDP2 has unsharded it (see dense.py).")
    return _TokenLogProbs.apply(hidden, head.weight, head.bias, ids, head, head.tile_rows(tile_elements))


@torch.no_grad()
def head_token_stats(
    hidden: torch.Tensor, head: OutputHead, ids: torch.Tensor, *, tile_elements: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-prob of token `ids` (N,), the entropy of the next-token distribution (N,) and whether the token is its
    argmax (N,, the first index among ties) at each position, from final hidden states (N, H); no grad, in tiles of
    positions. Only the positions given are projected: select the ones that matter before calling."""
    logps = hidden.new_empty(ids.shape, dtype=torch.float32)
    entropy = hidden.new_empty(ids.shape, dtype=torch.float32)
    is_top1 = torch.empty(ids.shape, dtype=torch.bool, device=hidden.device)
    rows = head.tile_rows(tile_elements)
    with head.gathered() as head:
        for start in range(0, hidden.size(0), rows):
            tile = slice(start, start + rows)
            tile_logps = head.logits(hidden[tile]).log_softmax(-1)
            logps[tile] = tile_logps.gather(-1, ids[tile, None])[:, 0]
            entropy[tile] = -(tile_logps.exp() * tile_logps).sum(-1)
            is_top1[tile] = tile_logps.argmax(-1) == ids[tile]
    return logps, entropy, is_top1


class _TokenLogProbs(torch.autograd.Function):
    """`log_softmax(transform(hidden @ W.T + b))[ids]` in tiles of positions; the backward recomputes each tile."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, head, rows):
        logps = hidden.new_empty(ids.shape, dtype=torch.float32)
        normalizers = hidden.new_empty(ids.size(0), dtype=torch.float32)
        with head.gathered() as whole:
            for start in range(0, hidden.size(0), rows):
                tile = slice(start, start + rows)
                logits = whole.logits(hidden[tile])
                normalizers[tile] = logits.logsumexp(-1)
                logps[tile] = logits.gather(-1, ids[tile]) - normalizers[tile, None]
        ctx.save_for_backward(hidden, weight, bias, ids, normalizers)
        ctx.head, ctx.rows = head, rows
        return logps

    @staticmethod
    def backward(ctx, grad_logps):
        hidden, weight, bias, ids, normalizers = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        # ZeRO-3 partitioned the weights again after the forward (a frozen FSDP2 head: whole in a copy)
        with ctx.head.gathered() as head:
            weight, bias = head.weight, head.bias
            grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
            wants_bias = bias is not None and ctx.needs_input_grad[2]
            grad_bias = torch.zeros_like(bias, dtype=torch.float32) if wants_bias else None
            for start in range(0, hidden.size(0), ctx.rows):
                tile = slice(start, start + ctx.rows)
                grad = grad_logps[tile].float()
                raw = torch.nn.functional.linear(hidden[tile].to(weight.dtype), weight, bias).float()
                # d/dz of sum_j g_j log p(ids_j) = onehot(ids) g - softmax * sum_j g_j, built in place; then the chain
                # rule through the transform z(raw)
                grad_logits = head.transform(raw).sub_(normalizers[tile, None]).exp_().mul_(-grad.sum(-1, keepdim=True))
                grad_logits.scatter_add_(-1, ids[tile], grad)
                if head.scale != 1.0 or head.softcap is not None or head.temperature != 1.0:
                    grad_logits.mul_(head.transform_grad(raw))
                if grad_hidden is not None:
                    grad_hidden[tile] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight.add_(_float32_product(grad_logits.T, hidden[tile], weight.dtype))
                if grad_bias is not None:
                    grad_bias.add_(grad_logits.sum(0))
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
        )


def _float32_product(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`a @ b` in float32. On a CUDA device, for a 16-bit `dtype`, the inputs are read in that dtype and the product
    accumulated and returned in float32 (the tensor cores' rate, about 10x a float32 product's, and no rounding of the
    result); elsewhere, and for other dtypes, a float32 product."""
    if a.device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a.to(dtype), b.to(dtype), out_dtype=torch.float32)
    return a.float() @ b.float()


@torch.no_grad()
def head_mass_beyond(
    hidden: torch.Tensor, head: OutputHead, ids: torch.Tensor, logps: torch.Tensor, *, vocab_size: int
) -> torch.Tensor:
    """Probability (N,) the head puts on ids >= `vocab_size` at each position, from final hidden states (N, H) and the
    log-probs `logps` (N,) of tokens `ids` (N,) under the whole head: only the extra rows are projected, and the
    normalizer comes from the known token, `log Z = z[id] - log p(id)`."""
    with head.gathered() as head:
        extra = replace(head, weight=head.weight[vocab_size:],
                        bias=None if head.bias is None else head.bias[vocab_size:])
        raw_token = (hidden.float() * head.weight[ids].float()).sum(-1)
        if head.bias is not None:
            raw_token = raw_token + head.bias[ids].float()
        log_normalizer = head.transform(raw_token) - logps
        return (extra.logits(hidden).logsumexp(-1) - log_normalizer).exp()
