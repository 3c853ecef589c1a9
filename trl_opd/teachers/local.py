"""A frozen teacher model in the training process: its backbone over prompt and completion, then its LM head over
the completion positions only.

The head projects a tile of positions onto the vocabulary at a time and keeps per-token statistics (log-prob of the
sampled token, entropy, whether it is the argmax), so no (batch, tokens, vocab) logits tensor is ever built, and the
prompt's positions, usually most of each sequence, are never projected.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from trl.models.utils import _ForwardRedirection
from trl.trainer.utils import disable_dropout_in_model

from ..heads import OutputHead, head_mass_beyond, head_token_stats, head_topk_logps
from ..secrets import masked
from .base import SourceSupport, TeacherScores

logger = logging.getLogger(__name__)
# Teacher probability on ids a smaller student cannot write, above which the dense terms' renormalisation is reported
OUTSIDE_MASS_WARNING = 1e-3


def freeze_teacher(model: torch.nn.Module) -> torch.nn.Module:
    """Freeze `model` for scoring (no gradient, eval mode, no dropout). Call before DeepSpeed/FSDP/PEFT wrap it."""
    model.requires_grad_(False)
    model.eval()
    disable_dropout_in_model(model)
    return model


def _describe(args) -> str:
    adapter = f" + adapter {args.teacher_adapter_name_or_path}" if args.teacher_adapter_name_or_path else ""
    return masked(f"{args.teacher_model_name_or_path}{adapter}")


SUPPORT = SourceSupport(
    name="local",
    chooses=("teacher_model_name_or_path",),
    option="a local teacher model (teacher_model_name_or_path)",
    estimators=("sampled", "topk", "full"),
    off_trainer=False,
    own_tokenizer=True,
    teacher_temperature=True,
    not_loaded=None,
    default_estimator="full",
    returns="log-probs, top-1, entropy, top-k, final hidden states",
    describe=_describe,
)

class OutsideMassCheck:
    """The warning a teacher whose head is in this process gives once, when its vocabulary is larger than the
    student's and it puts real probability beyond the student's ids. Needs `output_head` and `student_vocab_size`."""

    _checked_outside_mass = False

    def _check_outside_mass(self, hidden, completion_ids, completion_mask, logps) -> None:
        """On the first scored batch, warn if the teacher puts real probability on ids the student cannot write,
        which the dense terms leave out; untrained padding rows (e.g. 152,064 against 151,936) carry none."""
        extra_rows = self.output_head.vocab_size - (self.student_vocab_size or 0)
        if self._checked_outside_mass or not self.student_vocab_size or extra_rows <= 0:
            return
        self._checked_outside_mass = True
        valid = completion_mask.bool()
        mass = head_mass_beyond(hidden[valid], self.output_head, completion_ids[valid], logps[valid],
                                vocab_size=self.student_vocab_size)
        if mass.numel() and mass.max() > OUTSIDE_MASS_WARNING:
            logger.warning(
                "The teacher puts up to %.3g of its probability (mean %.3g) on its %d token ids beyond the student's "
                "vocabulary of %d. The dense terms compare the two over the student's ids only: 'full' renormalises "
                "the teacher over them, 'topk' counts that mass in its tail bucket.", mass.max().item(),
                mass.mean().item(), extra_rows, self.student_vocab_size,
            )


class LocalTeacher(OutsideMassCheck):
    """Scores completions with a model prepared by `freeze_teacher` (possibly wrapped by DeepSpeed ZeRO-3)."""

    _forward_redirection = _ForwardRedirection()

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        batch_size: int,
        autocast: Callable[[], AbstractContextManager] = nullcontext,
        return_hidden: bool = False,
        topk: int = 0,
        temperature: float = 1.0,
        student_vocab_size: int | None = None,
    ):
        self.model = model
        self.batch_size = batch_size
        self.autocast = autocast
        self.return_hidden = return_hidden  # keep the final hidden states too (the full estimator needs them)
        self.topk = topk  # also return the k most likely tokens at each position (the topk estimator)
        self.temperature = temperature  # the teacher's logits are divided by it (`teacher_temperature`)
        # the dense terms compare the two models over the student's ids; a teacher's extra rows (a larger vocabulary)
        # are left out: 'full' renormalises the teacher over the student's ids, 'topk' puts their mass in the tail
        self.student_vocab_size = student_vocab_size

    @property
    def causal_lm(self) -> torch.nn.Module:
        """The transformers model, under any DeepSpeed or accelerate wrapper."""
        return getattr(self.model, "module", self.model)

    @torch.no_grad()
    def score(self, prompt_ids, prompt_mask, completion_ids, completion_mask) -> TeacherScores:
        num_completion = completion_ids.size(1)
        if num_completion == 0:
            empty = completion_ids.new_zeros(completion_ids.shape, dtype=torch.float32)
            return TeacherScores(logps=empty, is_top1=empty.bool(), entropy=empty)
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, P+T)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # (B, P+T)
        valid = completion_mask.bool()  # padding is never projected
        logps = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
        entropy, is_top1 = torch.zeros_like(logps), torch.zeros_like(valid)
        head, hidden = self.output_head, []
        # Every rank runs the same number of forwards (equal local batches), as ZeRO-3's collective forward needs
        for start in range(0, input_ids.size(0), self.batch_size):
            rows = slice(start, start + self.batch_size)
            with self.autocast():
                # the states that predict the completion tokens: one position before each
                states = self._final_hidden(input_ids[rows], attention_mask[rows])[:, -num_completion - 1 : -1]
                stats = head_token_stats(states[valid[rows]], head, completion_ids[rows][valid[rows]])
            for out, values in zip((logps, entropy, is_top1), stats, strict=True):
                out[rows] = out[rows].masked_scatter(valid[rows], values)
            if self.return_hidden or self.topk:
                hidden.append(states)
        scores = TeacherScores(logps=logps, is_top1=is_top1, entropy=entropy)
        if hidden:
            hidden = torch.cat(hidden)  # (B, T, H)
            scores.hidden = hidden if self.return_hidden else None
            if self.topk:
                scores.topk_ids, scores.topk_logps = self._topk(hidden)
            self._check_outside_mass(hidden, completion_ids, completion_mask, scores.logps)
        return scores

    def _final_hidden(self, input_ids, attention_mask) -> torch.Tensor:
        """The backbone's final hidden states (B, L, H), called through any wrapper's forward (under ZeRO-3 that
        gathers the sharded weights, as the model's own forward would)."""
        backbone = self.causal_lm.base_model
        return self._forward_redirection(
            self.model, self.causal_lm,
            lambda **inputs: backbone(**inputs, use_cache=False).last_hidden_state,
            input_ids=input_ids, attention_mask=attention_mask,
        )

    @property
    def output_head(self) -> OutputHead:
        """The teacher's LM head with its logit transform, at `teacher_temperature`."""
        return OutputHead.of(self.causal_lm, temperature=self.temperature)

    def _topk(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely tokens and their log-probs at each position, (B, T, k) each, projected in tiles."""
        ids, logps = head_topk_logps(hidden.flatten(0, 1), self.output_head, k=self.topk,
                                     vocab_size=self.student_vocab_size)
        return ids.view(*hidden.shape[:2], -1), logps.view(*hidden.shape[:2], -1)
