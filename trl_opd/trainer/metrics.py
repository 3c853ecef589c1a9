"""The `opd/*` and `data/*` metrics of OPDTrainer, kept apart from its scoring and loss hooks.

Values come from the pure functions in `loss.py`, are reduced across processes, and go through GRPO's metric store.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..loss import opd_metric_sums, opd_metrics_from_sums
from ..teachers.base import TeacherScores

# How a metric that applies to nothing in its logging window reads wherever logged metrics are shown
NOT_APPLICABLE = "n/a"


def metric_text(value, spec: str = "") -> str:
    """A logged metric as text, `format(value, spec)`, or `NOT_APPLICABLE` for None and NaN: GRPO logs None for a
    metric with no valid value in the window (a reward function that returned None, "does not apply", for every
    completion), and the metric store's raw values are NaN there."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return NOT_APPLICABLE
    return format(value, spec)


class PassSums:
    """Sums over the micro-batches of one pass over a generation batch (GRPO trains its `steps_per_generation`
    micro-batches in turn, `num_iterations` times), for the metrics that are token means over the whole batch."""

    def __init__(self, rows: int):
        self.rows = rows  # this process's rows of the generation batch
        self.rows_seen, self.sums = 0, None

    def add(self, sums: torch.Tensor, rows: int) -> torch.Tensor | None:
        """`sums` of a micro-batch of `rows` rows added; the pass's sums once its last micro-batch is in (the next
        pass then starts from 0), else None."""
        self.sums = sums if self.sums is None else self.sums + sums
        self.rows_seen += rows
        if self.rows_seen < self.rows:
            return None
        sums, self.sums, self.rows_seen = self.sums, None, 0
        return sums


class CompletionTokenCount(TrainerCallback, ExportableState):
    """The completion tokens trained on so far (`data/completion_tokens_total`), saved in every checkpoint's trainer
    state (`stateful_callbacks`) and read back on resume (`restore`)."""

    def __init__(self, total: int = 0):
        self.total = total

    def state(self) -> dict:
        return {"args": {"total": self.total}, "attributes": {}}

    def restore(self, checkpoint) -> None:
        state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
        saved = state.get("stateful_callbacks", {}).get(type(self).__name__)
        saved = saved[0] if isinstance(saved, list) else saved
        if saved:
            self.total = saved["args"]["total"]


class OPDMetrics:
    """The `opd/*` and `data/*` metrics of a run, written to GRPO's metric store (`_metrics`, by mode) and its
    completions table (`_logs`), both held by reference. Batches whose advantages the loss forward forms, and dense
    terms, are logged once per generation batch as their token means over it, summed over its micro-batches."""

    def __init__(self, store: dict, table: dict, accelerator, callbacks: Callable[[], list], *,
                 log_advantage: bool = True):
        self.store, self.table, self.accelerator = store, table, accelerator
        self.log_advantage = log_advantage  # False where it is 0 by construction (`OPDPlan.advantage_zero`)
        self._callbacks = callbacks  # the Trainer's, where the completion token count lives
        self._window_tokens = 0
        self._window_start: float | None = None
        self._deferred: dict | None = None  # the generation batch whose advantages its loss forwards form
        # by mode (an evaluation can fall inside a training generation batch): the dense terms' sums of this batch
        self._dense_sums: dict[str, PassSums] = {}

    def log(self, mode: str, name: str, value: float) -> None:
        self.store[mode][name].append(value)

    # ------------------------------------------------------------------ the teacher's signal

    def log_generation_batch(self, mode, scores, old_per_token_logps, advantages, mask, completion_mask, *,
                             show_advantages: bool) -> None:
        """A generation batch's `opd/*` and `data/*` metrics, scored at generation, and with `show_advantages` (the
        teacher alone: GRPO filled the table with this batch's zero reward advantages) its advantages in the table."""
        self._log_metric_sums(mode, self._opd_metric_sums(scores, old_per_token_logps, advantages, mask,
                                                          completion_mask))
        if show_advantages:
            rows = mask.size(0)
            self._show_table_advantages(self.table_row_index(rows), advantages, mask,
                                        rows * self.accelerator.num_processes)

    def expect_deferred_rows(self, rows: int) -> None:
        """A generation batch of `rows` rows here whose metrics come from its micro-batches' loss forwards: they are
        summed over its rows and logged once, as those of a batch scored at generation are."""
        self._deferred = {"sums": PassSums(rows), "table_rows": rows * self.accelerator.num_processes}

    def log_deferred(self, mode, inputs, scores: TeacherScores, old_per_token_logps, advantages, *,
                     show_advantages: bool) -> None:
        """One micro-batch's share of its generation batch's `opd/*` metrics, with `old_per_token_logps` the loss
        forward's detached log-probs (the sampling policy's, on-policy), and its rows' advantages in the table."""
        mask = inputs["action_mask"]
        sums = self._opd_metric_sums(scores, old_per_token_logps, advantages, mask, inputs["completion_mask"])
        sums = self._deferred["sums"].add(sums, mask.size(0))
        if sums is not None:
            self._log_metric_sums(mode, sums)
        if show_advantages:
            self._show_table_advantages(inputs["opd_table_row"], advantages, mask, self._deferred["table_rows"])
        if inputs.get("sampling_per_token_logps") is not None:  # vLLM sampled: its gap to the trainer's log-probs
            old = old_per_token_logps
            delta = (old - inputs["sampling_per_token_logps"]).abs()[mask.bool()]
            delta = delta[~torch.isnan(delta)]
            mean, top = (delta.mean(), delta.max()) if delta.numel() else (old.new_zeros(()), old.new_zeros(()))
            self.log(mode, "sampling/sampling_logp_difference/mean", self.accelerator.gather(mean).mean().item())
            self.log(mode, "sampling/sampling_logp_difference/max", self.accelerator.gather(top).max().item())

    def log_entropy(self, mode: str, entropy_sum: torch.Tensor, count: torch.Tensor) -> None:
        """GRPO's `entropy` exactly, where its loss forward did not run (its `_compute_loss` logs each micro-batch's
        token mean over all processes), so that a run logs one `entropy` whichever the path (tests/test_trl_hooks.py
        pins its formula)."""
        totals = self.accelerator.reduce(torch.stack([entropy_sum, count.float()]), "sum")
        self.log(mode, "entropy", (totals[0] / totals[1].clamp(min=1.0)).item())

    # ------------------------------------------------------------------ dense terms

    def expect_dense_rows(self, mode: str, rows: int) -> None:
        """A generation batch of `rows` rows here, with a dense term: its metrics are summed over its micro-batches
        (`log_dense_sums`)."""
        self._dense_sums[mode] = PassSums(rows)

    def log_dense_sums(self, mode: str, sums: dict[str, torch.Tensor], count: torch.Tensor, rows: int) -> None:
        """One micro-batch's share (`rows` rows, `count` distilled tokens here) of its generation batch's dense-term
        metrics, `sums` of each over those tokens; each is logged once the batch's last micro-batch is in, as its
        token mean over all processes: the definition of the `opd/*` metrics scored at generation too (a mean of
        micro-batch means would weigh a micro-batch's tokens by how few they are)."""
        local = torch.stack([*(value.detach().float() for value in sums.values()), count.float()])
        totals = self._dense_sums[mode].add(local, rows)
        if totals is None:
            return
        totals = self.accelerator.reduce(totals, reduction="sum")  # every process reaches its batch's end together
        for name, total in zip(sums, totals[:-1], strict=True):
            self.log(mode, name, (total / totals[-1].clamp(min=1.0)).item())

    # ------------------------------------------------------------------ sums and the completions table

    def _opd_metric_sums(self, scores, old_per_token_logps, advantages, mask, completion_mask) -> torch.Tensor:
        """`opd_metric_sums` with the sequence and completion-token counts, summed over processes."""
        sums = opd_metric_sums(
            teacher_per_token_logps=scores.logps,
            old_per_token_logps=old_per_token_logps,
            advantages=advantages if self.log_advantage else None,  # None: the metric is not logged
            mask=mask,
            teacher_is_top1=scores.is_top1,
            teacher_entropy=scores.entropy,
            chunk_ends=scores.chunk_ends,
        )
        counts = torch.tensor([float(mask.size(0)), completion_mask.sum().item()], device=sums.device)
        return self.accelerator.reduce(torch.cat([sums, counts]), reduction="sum")

    def _log_metric_sums(self, mode, sums) -> None:
        sums, (num_sequences, num_completion_tokens) = sums[:-2], sums[-2:].tolist()
        for name, value in opd_metrics_from_sums(sums).items():
            self.log(mode, name, value)
        num_tokens = int(sums[0].item())
        # multi-turn: the share of completion tokens that are the student's actions (1.0 when single-turn)
        self.log(mode, "opd/action_token_fraction", num_tokens / max(num_completion_tokens, 1.0))
        self.log(mode, "data/completion_tokens_mean", num_tokens / max(num_sequences, 1.0))

    def table_row_index(self, rows: int) -> torch.Tensor:
        """This process's `rows` rows' places in the gathered generation batch, GRPO's completions table's order."""
        return torch.arange(rows, device=self.accelerator.device) + self.accelerator.process_index * rows

    def _show_table_advantages(self, rows, advantages, mask, table_rows: int) -> None:
        """Each row's mean advantage at its place in GRPO's completions table (a bounded deque that ends with the
        `table_rows` rows of the batch being trained: an eval batch larger than its bound left only its tail there,
        and rows that fell off its front are skipped)."""
        sequence_advantage = (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        pairs = self.accelerator.gather(torch.stack([rows.to(sequence_advantage.dtype), sequence_advantage], -1))
        table = self.table["advantages"]
        first = table_rows - len(table)  # the batch row at the table's front
        for row, value in pairs.tolist():
            if int(row) >= first:
                table[int(row) - first] = value

    # ------------------------------------------------------------------ throughput

    @property
    def token_count(self) -> CompletionTokenCount:
        """The count callback in use (a Trainer that restores callback states replaces the one added at start-up)."""
        return next(cb for cb in self._callbacks() if isinstance(cb, CompletionTokenCount))

    def count_completion_tokens(self, num_tokens: int) -> None:
        """Add a training generation batch's sampled tokens, all processes, to `data/completion_tokens_*`: once per
        generation batch, however many times its micro-batches are trained on (`num_iterations`)."""
        self.token_count.total += num_tokens
        self._window_tokens += num_tokens

    def start_window(self) -> None:
        """A training step begins: the first one starts the throughput window."""
        if self._window_start is None:
            self._window_start = time.perf_counter()

    def add_throughput(self, logs: dict) -> None:
        """`data/completion_tokens_per_second` since the last log, and `data/completion_tokens_total`, into `logs`."""
        if self._window_tokens and self._window_start is not None:
            now = time.perf_counter()
            logs["data/completion_tokens_per_second"] = self._window_tokens / (now - self._window_start)
            logs["data/completion_tokens_total"] = self.token_count.total
            self._window_tokens, self._window_start = 0, now
