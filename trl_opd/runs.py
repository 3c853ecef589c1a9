"""What keeps a run's data whole: it starts in its own output directory or resumes a checkpoint of the same model,
and it stops, on every rank at once, at the first non-finite number rather than train on it or save it."""

from __future__ import annotations

import math
import shutil

import torch

from .checkpoints import check_resume_matches, old_checkpoints, resolve_resume


class RunSafetyMixin:
    """Mixed into OPDTrainer first; every method calls `super()` where the Trainer has one. Reads the Trainer's
    `args`, `accelerator`, `model` and `state`, and GRPO's `log_completions`."""

    def train(self, resume_from_checkpoint=None, **kwargs):
        """`resume_from_checkpoint=True` resumes from the newest *complete* checkpoint, skipping one whose save was
        interrupted (the Trainer would take the newest directory, whole or not)."""
        resume_from_checkpoint = resolve_resume(resume_from_checkpoint, self.args.output_dir)
        if resume_from_checkpoint is None:
            self._claim_output_dir()
        else:
            check_resume_matches(resume_from_checkpoint, self.accelerator.unwrap_model(self.model))
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def _claim_output_dir(self) -> None:
        """A new run starts in an empty output_dir (but for the empty folders its trainer made there), or in a used
        one only with `overwrite_output_dir` (see `old_checkpoints`), whose checkpoints the main process deletes
        first."""
        # GRPO's constructor makes `completions` (empty) for the completion tables of log_completions
        own = ("completions",) if self.log_completions else ()
        stale = old_checkpoints(self.args.output_dir, overwrite=self.args.overwrite_output_dir, own=own)
        if self.accelerator.is_main_process:
            for checkpoint in stale:
                shutil.rmtree(checkpoint)
        self.accelerator.wait_for_everyone()

    def _check_finite(self, teacher_logps, old_logps, mask) -> None:
        """Fail, on every rank at once, if any scored token has a NaN/inf log-prob: never train on it silently."""
        mask = mask.bool()
        bad_old = mask.new_zeros(()) if old_logps is None else (~torch.isfinite(old_logps) & mask).sum()
        counts = torch.stack([(~torch.isfinite(teacher_logps) & mask).sum(), bad_old, mask.sum()])
        bad_teacher, bad_student, total = self.accelerator.reduce(counts, reduction="sum").tolist()
        if bad_teacher or bad_student:
            raise FloatingPointError(
                f"Step {self.state.global_step}: non-finite log-probs on sampled tokens (teacher: {bad_teacher}, "
                f"student: {bad_student}, of {total}). Training stopped rather than learn from them; the last "
                "checkpoint is intact. Check the teacher's dtype (float16 overflows) and its weights."
            )

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        """Stop, on every rank at once, at the first non-finite loss or gradient norm: before this step's logs and
        checkpoint, so every checkpoint already saved is one of a finite run."""
        bad = torch.stack([(~torch.isfinite(tr_loss)).any().float(),
                           torch.tensor(float(grad_norm is not None and not math.isfinite(float(grad_norm))),
                                        device=tr_loss.device)])
        bad_loss, bad_norm = self.accelerator.reduce(bad, reduction="sum").tolist()
        if bad_loss or bad_norm:
            raise FloatingPointError(
                f"Step {self.state.global_step}: the {'loss' if bad_loss else 'gradient norm'} is not finite; "
                "training stopped before saving this step (earlier checkpoints are intact). Likely causes: a learning "
                "rate too high for this model, float16 overflow (use bf16 or float32), or a teacher that gives "
                "probability 0 to sampled tokens (check opd/teacher_logp)."
            )
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)
