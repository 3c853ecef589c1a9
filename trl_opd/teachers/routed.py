"""Several teachers, each scoring the rows a dataset column routes to it (mixed-domain distillation)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .base import TeacherScorer, TeacherScores


class RoutedTeacher:
    """Scores each row with `scorers[routes[row]]`, local and served teachers alike, and reassembles the batch.

    A statistic (argmax agreement, entropy) is returned only if every teacher that scored a row provides it.

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

    def score(self, prompt_ids, prompt_mask, completion_ids, completion_mask, *, routes: list[str]) -> TeacherScores:
        unknown = sorted(set(routes) - set(self.scorers))
        if unknown:
            row = next(i for i, route in enumerate(routes) if route in unknown)
            raise ValueError(
                f"Row {row} of the batch is routed to teacher {unknown[0]!r}, which is not among the configured "
                f"teachers {sorted(self.scorers)}."
            )
        logps = torch.zeros(completion_ids.shape, device=completion_ids.device)
        is_top1 = torch.zeros(completion_ids.shape, dtype=torch.bool, device=completion_ids.device)
        entropy = torch.zeros(completion_ids.shape, device=completion_ids.device)
        complete = {"is_top1": True, "entropy": True}
        for name, scorer in self.scorers.items():  # the same order on every rank
            own = [i for i, route in enumerate(routes) if route == name]
            scored = own
            if name in self.collective:
                scored = own + [0] * (self.max_over_ranks(len(own)) - len(own))  # dummy rows, dropped below
            if not scored:
                continue
            index = torch.tensor(scored, dtype=torch.long, device=completion_ids.device)
            scores = scorer.score(prompt_ids[index], prompt_mask[index], completion_ids[index], completion_mask[index])
            rows, n = index[: len(own)], len(own)
            logps[rows] = scores.logps[:n].to(logps.dtype)
            for field, target in (("is_top1", is_top1), ("entropy", entropy)):
                value = getattr(scores, field)
                if value is None:
                    complete[field] = False
                else:
                    target[rows] = value[:n].to(target.dtype)
        return TeacherScores(
            logps=logps,
            is_top1=is_top1 if complete["is_top1"] else None,
            entropy=entropy if complete["entropy"] else None,
        )
