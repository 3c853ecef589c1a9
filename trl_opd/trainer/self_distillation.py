"""The student as its own teacher (`student_as_teacher`; each kind's scorer is `teachers.student.self_teacher`): the
'ema' kind's averaging after optimizer steps, and its teacher's weights in every checkpoint (they are not the
student's, and a resumed run must continue from them, not from the student's starting weights). Also the reference
copy's starting weights, which the initial and 'ema' kinds, `ref_as_teacher` and GRPO's KL penalty read.
"""

from __future__ import annotations

from pathlib import Path

from accelerate.utils import is_peft_model
from transformers import TrainerCallback

from ..teachers.student import TeacherAverage, add_ema_adapter, copy_parameters, ema_pairs

EMA_WEIGHTS = "teacher_ema.safetensors"  # in each checkpoint of a run with student_as_teacher: ema


def reference_from_student(student, ref_model, *, zero3: bool) -> None:
    """GRPO builds its reference copy of a fully fine-tuned student from the checkpoint the student's config names;
    a student passed as a model may have moved since it was loaded (an SFT stage in the same process), and the
    reference (the KL penalty's, `ref_as_teacher`'s, or `student_as_teacher`'s initial and 'ema' teachers) must be
    the student as it was passed. A PEFT student needs nothing: its reference is its own base weights."""
    if ref_model is not None:
        copy_parameters(ema_pairs(student, getattr(ref_model, "module", ref_model)), zero3=zero3)


class TeacherEMA(TrainerCallback):
    """The 'ema' teacher's moving average: its copy of the weights (a PEFT student's "ema" adapter; GRPO's reference
    copy otherwise, made the student's starting weights) and their float32 average, moved towards the student every
    `teacher_ema_steps` optimizer steps, saved in every checkpoint and restored on resume (once the models are
    placed: under DeepSpeed the Trainer loads checkpoints its own way, never through `_load_from_checkpoint`)."""

    def __init__(self, student, ref_model, *, rate: float, every: int, zero3: bool):
        if is_peft_model(student):
            add_ema_adapter(student)
        self._student, self._copy = student, None if is_peft_model(student) else getattr(ref_model, "module", ref_model)
        self.rate, self.every, self.zero3 = rate, every, zero3
        self.average = TeacherAverage(self.pairs(), zero3=zero3)
        self._resume_from = None

    def pairs(self) -> dict:
        """The teacher's copy and the student's weights, by parameter name (`teachers.student.ema_pairs`)."""
        return ema_pairs(self._student, self._copy)

    def resume_from(self, checkpoint) -> None:
        """Restore the average from `checkpoint` (a path, or None for a new run) when training begins."""
        if checkpoint is not None and not (Path(checkpoint) / EMA_WEIGHTS).is_file():
            raise ValueError(
                f"{checkpoint} has no {EMA_WEIGHTS}: it was not written by a run with student_as_teacher: ema, so the "
                "teacher's averaged weights cannot be restored. Resume it with the kind it was trained with, or start "
                "a new run."
            )
        self._resume_from = checkpoint

    def on_train_begin(self, args, state, control, **kwargs):
        if self._resume_from is not None:
            self.restore(self._resume_from)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            self.update()

    def update(self) -> None:
        self.average.update(self.pairs(), self.rate)

    def save(self, output_dir: Path, *, is_main_process: bool) -> None:
        """The teacher's float32 average (a collective under ZeRO-3), written by the main process."""
        from safetensors.torch import save_file

        tensors = self.average.state_dict(self.pairs())
        if is_main_process:
            output_dir.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(output_dir / EMA_WEIGHTS))

    def restore(self, checkpoint) -> None:
        from safetensors.torch import load_file

        path = Path(checkpoint) / EMA_WEIGHTS
        saved, pairs = load_file(str(path)), self.pairs()
        if saved.keys() != pairs.keys():
            raise ValueError(f"{path} holds other parameters than this run's 'ema' teacher: it was written for "
                             "another model or adapter.")
        self.average.load_state_dict(pairs, saved)
