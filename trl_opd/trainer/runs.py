"""What keeps a run's data whole: it starts in its own output directory or resumes a checkpoint of the same model,
and it stops, on every rank at once, at the first non-finite number rather than train on it or save it."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from .checkpoints import check_resume_matches, old_checkpoints, resolve_resume


def claim_output_dir(args, accelerator, *, own: tuple[str, ...] = ()) -> None:
    """A new run starts in an empty output_dir (but for the empty folders its trainer made there, `own`), or in a used
    one only with `overwrite_output_dir` (see `old_checkpoints`), whose checkpoints the main process deletes first."""
    stale = old_checkpoints(args.output_dir, overwrite=args.overwrite_output_dir, own=own)
    if accelerator.is_main_process:
        for checkpoint in stale:
            shutil.rmtree(checkpoint)
    accelerator.wait_for_everyone()


def resume_or_claim(args, accelerator, model, resume_from_checkpoint, *, own: tuple[str, ...] = ()):
    """The checkpoint a run resumes from, or None for a new run, which claims its output directory.
    `resume_from_checkpoint=True` is the newest *complete* checkpoint, skipping one whose save was interrupted (the
    Trainer would take the newest directory, whole or not); a checkpoint must be of `model`."""
    resume_from_checkpoint = resolve_resume(resume_from_checkpoint, args.output_dir)
    if resume_from_checkpoint is None:
        claim_output_dir(args, accelerator, own=own)
        return None
    check_resume_matches(resume_from_checkpoint, model)
    step = json.loads((Path(resume_from_checkpoint) / "trainer_state.json").read_text())["global_step"]
    if 0 < args.max_steps <= step:
        raise RunFinished(
            f"Nothing to train: {resume_from_checkpoint} is at step {step}, and max_steps is {args.max_steps}. Raise "
            f"max_steps to train on from it (e.g. --max_steps {2 * step}), or start a new run in another output_dir."
        )
    return resume_from_checkpoint


class RunFinished(ValueError):
    """Resuming a run whose checkpoint is at max_steps already: the command line says so and exits 0, saving nothing
    (the trainer's weights are not the checkpoint's)."""


def check_finite_logps(teacher_logps, old_logps, mask, *, accelerator, step: int) -> None:
    """Fail, on every rank at once, if any scored token has a NaN/inf log-prob: never train on it silently."""
    mask = mask.bool()
    bad_old = mask.new_zeros(()) if old_logps is None else (~torch.isfinite(old_logps) & mask).sum()
    counts = torch.stack([(~torch.isfinite(teacher_logps) & mask).sum(), bad_old, mask.sum()])
    bad_teacher, bad_student, total = accelerator.reduce(counts, reduction="sum").tolist()
    if bad_teacher or bad_student:
        raise FloatingPointError(
            f"Step {step}: non-finite log-probs on sampled tokens (teacher: {bad_teacher}, student: {bad_student}, of "
            f"{total}). Training stopped rather than learn from them; the last checkpoint is intact. Check the "
            "teacher's dtype (float16 overflows) and its weights."
        )


def check_finite_step(tr_loss, grad_norm, *, accelerator, step: int) -> None:
    """Stop, on every rank at once, at the first non-finite loss or gradient norm: before this step's logs and
    checkpoint, so every checkpoint already saved is one of a finite run."""
    bad = torch.stack([(~torch.isfinite(tr_loss)).any().float(),
                       torch.tensor(float(grad_norm is not None and not math.isfinite(float(grad_norm))),
                                    device=tr_loss.device)])
    bad_loss, bad_norm = accelerator.reduce(bad, reduction="sum").tolist()
    if bad_loss or bad_norm:
        raise FloatingPointError(
            f"Step {step}: the {'loss' if bad_loss else 'gradient norm'} is not finite; training stopped before "
            "saving this step (earlier checkpoints are intact). Likely causes: a learning rate too high for this "
            "model, float16 overflow (use bf16 or float32), or a teacher that gives probability 0 to sampled tokens "
            "(check opd/teacher_logp)."
        )
