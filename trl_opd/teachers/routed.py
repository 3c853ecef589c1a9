"""Several teachers, each scoring the rows a dataset column routes to it (mixed-domain distillation)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..secrets import masked
from .base import SourceSupport, TeacherScorer, TeacherScores

# What routed teachers support together is what each of them does (`teachers.sources.source_support`); this is what
# routing itself adds or takes away
SUPPORT = SourceSupport(
    name="routed",
    chooses=("teachers",),
    option="routed teachers (teachers)",
    estimators=("sampled", "topk", "full"),
    off_trainer=True,
    own_tokenizer=True,
    teacher_temperature=True,
    not_loaded=None,
    default_estimator="servers",
    returns="each row's teacher's scores; 'full' states padded to the widest teacher, with each row's head",
    describe=lambda args: "routed per row: " + ", ".join(f"{name}: {masked(source)}"
                                                         for name, source in args.teachers.items()),
)

class RoutedTeacher:
    """Scores each row with `scorers[routes[row]]`, local and served teachers alike (each wrapped for its own
    tokenizer in cross mode), and reassembles the batch.

    A statistic (argmax agreement, entropy) is returned only if every teacher that scored a row provides it. So are
    the dense estimators' fields: a top-k (the same k from every teacher), and for 'full' each row's final hidden
    states, padded to the widest teacher's, with the index of the teacher whose head projects them (`output_heads`).

    A teacher sharded across processes (DeepSpeed ZeRO-3) runs each forward as a collective, so every rank must run as
    many forwards of it as the others, whatever the routes of its own rows: for the teachers named in `collective`,
    each rank's rows are padded with copies of its first row up to the largest count on any rank
    (`max_over_ranks(count)`, itself a collective), and the copies' scores are dropped.
    """

    def __init__(self, scorers: dict[str, TeacherScorer], *, collective: tuple[str, ...] = (),
                 max_over_ranks: Callable[[int], int] | None = None):
        if collective and max_over_ranks is None:
            raise ValueError("Collective teachers need max_over_ranks, the largest row count on any process.")
        self.scorers = scorers
        self.collective = collective
        self.max_over_ranks = max_over_ranks

    @property
    def output_heads(self) -> tuple:
        """Each teacher's LM head, in the order of `TeacherScores.hidden_route` (for the full estimator)."""
        return tuple(scorer.output_head for scorer in self.scorers.values())

    def score(self, *batch, routes: list[str]) -> TeacherScores:
        """`batch` is what each scorer takes, one row per route: tensors (rows first) or lists (a cross-tokenizer
        teacher's prompts and messages); every field of the scores that each teacher gives is reassembled in the
        batch's order."""
        unknown = sorted(set(routes) - set(self.scorers))
        if unknown:
            row = next(i for i, route in enumerate(routes) if route in unknown)
            raise ValueError(
                f"Row {row} of the batch is routed to teacher {unknown[0]!r}, which is not among the configured "
                f"teachers {sorted(self.scorers)}."
            )
        mask = next(part for part in reversed(batch) if isinstance(part, torch.Tensor))  # the completion/action mask
        shape, device = mask.shape, mask.device  # (B, T)
        pieces: dict[str, list | None] = {}  # field -> (rows, values) per teacher; None once one cannot tell
        route_of_row = torch.zeros(shape[0], dtype=torch.long, device=device)
        for number, (name, scorer) in enumerate(self.scorers.items()):  # the same order on every rank
            own = [i for i, route in enumerate(routes) if route == name]
            scored = own
            if name in self.collective:
                scored = own + [0] * (self.max_over_ranks(len(own)) - len(own))  # dummy rows, dropped below
            if not scored:
                continue
            index = torch.tensor(scored, dtype=torch.long, device=device)
            scores = scorer.score(*(part[index] if isinstance(part, torch.Tensor) else [part[i] for i in scored]
                                    for part in batch))
            route_of_row[index[: len(own)]] = number
            for field in _ROW_FIELDS if own else ():
                value = getattr(scores, field)
                if value is None:
                    pieces[field] = None
                elif pieces.setdefault(field, []) is not None:
                    pieces[field].append((index[: len(own)], value[: len(own)]))

        def assembled(field: str) -> torch.Tensor | None:
            if not pieces.get(field):
                return None
            values = [value for _, value in pieces[field]]
            dtype = values[0].dtype if len({value.dtype for value in values}) == 1 else torch.float32
            dtype = torch.float32 if dtype.is_floating_point and field not in _DENSE_FIELDS else dtype
            # (B, T) or, for the dense fields, (B, T, k) and (B, T, H) padded with zeros to the widest teacher's
            trailing = tuple(max(sizes) for sizes in zip(*(value.shape[2:] for value in values), strict=True))
            out = torch.zeros(*shape, *trailing, dtype=dtype, device=device)
            for rows, value in pieces[field]:
                out[(rows, slice(None), *(slice(0, size) for size in value.shape[2:]))] = value.to(dtype)
            return out

        scores = TeacherScores(**{field: assembled(field) for field in _ROW_FIELDS})
        if scores.hidden is not None:
            scores.hidden_route = route_of_row
        return scores


# The fields of TeacherScores a routed batch carries: (B, T), and the dense estimators' (B, T, ...), kept in the dtype
# their teachers give
_DENSE_FIELDS = ("hidden", "topk_ids", "topk_logps")
_ROW_FIELDS = ("logps", "is_top1", "entropy", "chunk_ends", "aligned", "text_chunk_ends", *_DENSE_FIELDS)
