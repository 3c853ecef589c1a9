"""Several teachers, each scoring the rows a dataset column routes to it (mixed-domain distillation)."""

from __future__ import annotations

import torch

from .base import TeacherScorer, TeacherScores


class RoutedTeacher:
    """Scores each row with `scorers[routes[row]]`, local and served teachers alike, and reassembles the batch.

    A statistic (argmax agreement, entropy) is returned only if every teacher that scored a row provides it.
    """

    def __init__(self, scorers: dict[str, TeacherScorer]):
        self.scorers = scorers

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
        for name, scorer in self.scorers.items():
            rows = torch.tensor([i for i, route in enumerate(routes) if route == name], dtype=torch.long)
            if len(rows) == 0:
                continue
            rows = rows.to(completion_ids.device)
            scores = scorer.score(prompt_ids[rows], prompt_mask[rows], completion_ids[rows], completion_mask[rows])
            logps[rows] = scores.logps.to(logps.dtype)
            for field, target in (("is_top1", is_top1), ("entropy", entropy)):
                value = getattr(scores, field)
                if value is None:
                    complete[field] = False
                else:
                    target[rows] = value.to(target.dtype)
        return TeacherScores(
            logps=logps,
            is_top1=is_top1 if complete["is_top1"] else None,
            entropy=entropy if complete["entropy"] else None,
        )
