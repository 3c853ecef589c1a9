"""The one interface every teacher source implements: per-token log-probs aligned to the student's completion."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

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


@dataclass(frozen=True)
class SourceSupport:
    """What a teacher source can do, declared as `SUPPORT` beside its scorer and read by the option checks
    (`config_checks.py`, `checks.py`) through `teachers.sources.source_support`, so that no check matches source
    names."""

    name: str  # as `OPDConfig.teacher_source` returns it
    chooses: tuple[str, ...]  # the OPDConfig options that choose it (one source a run)
    option: str  # how messages name it
    estimators: tuple[str, ...]  # the estimators whose teacher side it returns ('sampled' always)
    off_trainer: bool  # scores away from the trainer's processes: `opd_overlap_scoring` has something to overlap
    own_tokenizer: bool  # may read the text with a tokenizer of its own (`teacher_tokenizer_mode: cross`)
    teacher_temperature: bool  # `teacher_temperature` applies (a self-teacher scores at the sampling temperature)
    # why `teacher_model_init_kwargs` would be ignored, or None where this source loads a model from a path
    not_loaded: str | None
    # `opd_estimator` left unset: the best this source gives ("servers": what its servers give, asked of them)
    default_estimator: str
    returns: str  # what its scores hold
    describe: Callable[[Any], str]  # the teacher of a run's OPDConfig as its model card names it, without secrets
