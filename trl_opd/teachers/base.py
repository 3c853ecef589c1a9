"""The one interface every teacher source implements: per-token log-probs aligned to the student's completion."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class TeacherScores:
    """The teacher's view of each sampled completion token, each (B, T) and aligned to `completion_ids`.

    Positions where the completion mask is 0 hold 0 (or False) and must not be read.
    """

    logps: torch.Tensor  # log pi_T(a_t | s_t)
    is_top1: torch.Tensor | None = None  # a_t is the teacher's argmax; None when the source cannot tell
    entropy: torch.Tensor | None = None  # H(pi_T(. | s_t)); None when the source cannot compute it for free
    hidden: torch.Tensor | None = None  # (B, T, H) final hidden states at s_t, for the full estimator
    # (B,) routed teachers: the index of the head (`RoutedTeacher.output_heads`) that projects each row's `hidden`,
    # whose first H_r of H (the widest teacher's) values are that teacher's
    hidden_route: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None  # (B, T, k) the teacher's k most likely tokens at s_t, for the topk estimator
    topk_logps: torch.Tensor | None = None  # (B, T, k) their log-probs, in decreasing order
    # A teacher with another tokenizer scores chunks of text, not tokens: `logps` then holds each chunk's log-prob on
    # its last student token (True in `chunk_ends`) and 0 on the others; `aligned` is False on sampled tokens in no
    # chunk, which are not distilled. None: every token is its own chunk.
    chunk_ends: torch.Tensor | None = None  # (B, T) bool
    aligned: torch.Tensor | None = None  # (B, T) bool
    # where the two tokenisations' common boundaries fall (a cross-tokenizer teacher), for the alignment metrics,
    # whether or not its advantage steps by chunk
    text_chunk_ends: torch.Tensor | None = None  # (B, T) bool


class TeacherScorer(Protocol):
    """Scores the exact token ids the student sampled. Knows nothing of advantages or losses."""

    def score(
        self,
        prompt_ids: torch.Tensor,  # (B, P), left-padded
        prompt_mask: torch.Tensor,  # (B, P)
        completion_ids: torch.Tensor,  # (B, T), right-padded
        completion_mask: torch.Tensor,  # (B, T)
    ) -> TeacherScores: ...
