"""The student as its own teacher (`student_as_teacher`): the scorer of each kind, the 'ema' kind's averaging after
optimizer steps, and its teacher's weights in every checkpoint (they are not the student's, and a resumed run must
continue from them, not from the student's starting weights). Also the reference copy's starting weights, which the
initial and 'ema' kinds, `ref_as_teacher` and GRPO's KL penalty read.
"""

from __future__ import annotations

from pathlib import Path

from accelerate.utils import is_peft_model
from transformers import TrainerCallback

from .teachers.student import EMA_ADAPTER, StudentTeacher, TeacherAverage, add_ema_adapter, copy_parameters, ema_pairs

EMA_WEIGHTS = "teacher_ema.safetensors"  # in each checkpoint of a run with student_as_teacher: ema


class _TeacherEMA(TrainerCallback):
    """Restores the 'ema' teacher of a resumed run once the models are placed (under DeepSpeed the Trainer loads
    checkpoints its own way, never through `_load_from_checkpoint`), and moves it towards the student every
    `teacher_ema_steps` optimizer steps."""

    def __init__(self, trainer):
        self.trainer, self.resume_from = trainer, None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.resume_from is not None:
            self.trainer._restore_teacher_ema(self.resume_from)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.teacher_ema_steps == 0:
            self.trainer._update_teacher_ema()


class SelfDistillationMixin:
    """Mixed into OPDTrainer before GRPOTrainer. Reads GRPO's `args`, `model`, `ref_model`, `accelerator` and
    `is_deepspeed_enabled`; the trainer calls `_reference_from_student` (for a student passed as a model) and
    `_prepare_self_teacher` once GRPO's set-up is done."""

    def _reference_from_student(self) -> None:
        """GRPO builds its reference copy of a fully fine-tuned student from the checkpoint the student's config names;
        a student passed as a model may have moved since it was loaded (an SFT stage in the same process), and the
        reference (the KL penalty's, `ref_as_teacher`'s, or `student_as_teacher`'s initial and 'ema' teachers) must be
        the student as it was passed. A PEFT student needs nothing: its reference is its own base weights."""
        if self.ref_model is None:
            return
        copy_parameters(ema_pairs(self.accelerator.unwrap_model(self.model),
                                  getattr(self.ref_model, "module", self.ref_model)), zero3=self._zero3())

    def _prepare_self_teacher(self) -> None:
        """The 'ema' kind's copy of the weights (a PEFT student's "ema" adapter; GRPO's reference copy otherwise,
        built at set-up and made the student's starting weights), its float32 average and its averaging callback."""
        if self.args.student_as_teacher != "ema":
            return
        student = self.accelerator.unwrap_model(self.model)
        if is_peft_model(student):
            add_ema_adapter(student)
        self._teacher_average = TeacherAverage(self._teacher_ema_pairs(), zero3=self._zero3())
        self._teacher_ema = _TeacherEMA(self)
        self.add_callback(self._teacher_ema)

    def train(self, resume_from_checkpoint=None, **kwargs):
        if self.args.student_as_teacher == "ema":  # a path here: `RunSafetyMixin.train` resolved it
            if resume_from_checkpoint is not None and not (Path(resume_from_checkpoint) / EMA_WEIGHTS).is_file():
                raise ValueError(
                    f"{resume_from_checkpoint} has no {EMA_WEIGHTS}: it was not written by a run with "
                    "student_as_teacher: ema, so the teacher's averaged weights cannot be restored. Resume it with the "
                    "kind it was trained with, or start a new run."
                )
            self._teacher_ema.resume_from = resume_from_checkpoint
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def _self_teacher(self, **scoring) -> StudentTeacher:
        """The scorer of `student_as_teacher`'s kind, over the model that holds its weights."""
        kind, student = self.args.student_as_teacher, self.accelerator.unwrap_model(self.model)
        if kind == "live":
            return StudentTeacher(lambda: self.model, adapter=StudentTeacher.LIVE, **scoring)
        if is_peft_model(student):
            initial = "ref" if "ref" in student.peft_config else None  # a pretrained adapter's copy, else none
            return StudentTeacher(lambda: self.model, adapter=EMA_ADAPTER if kind == "ema" else initial, **scoring)
        return StudentTeacher(lambda: self.ref_model, adapter=None, **scoring)

    def _teacher_ema_pairs(self):
        student = self.accelerator.unwrap_model(self.model)
        copy = None if is_peft_model(student) else getattr(self.ref_model, "module", self.ref_model)
        return ema_pairs(student, copy)

    def _update_teacher_ema(self) -> None:
        self._teacher_average.update(self._teacher_ema_pairs(), self.args.teacher_ema_rate)

    def _zero3(self) -> bool:
        plugin = self.accelerator.state.deepspeed_plugin if self.is_deepspeed_enabled else None
        return plugin is not None and plugin.zero_stage == 3

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """The student, and with the 'ema' kind its teacher's weights beside it (before the trainer state, which a
        checkpoint writes last)."""
        super().save_model(output_dir, _internal_call)
        if self.args.student_as_teacher == "ema":
            self._save_teacher_ema(Path(output_dir or self.args.output_dir))

    def _save_teacher_ema(self, output_dir: Path) -> None:
        """The teacher's float32 average (a collective under ZeRO-3), written by the main process."""
        from safetensors.torch import save_file

        tensors = self._teacher_average.state_dict(self._teacher_ema_pairs())
        if self.accelerator.is_main_process:
            output_dir.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(output_dir / EMA_WEIGHTS))

    def _restore_teacher_ema(self, resume_from_checkpoint) -> None:
        from safetensors.torch import load_file

        path = Path(resume_from_checkpoint) / EMA_WEIGHTS
        saved, pairs = load_file(str(path)), self._teacher_ema_pairs()
        if saved.keys() != pairs.keys():
            raise ValueError(f"{path} holds other parameters than this run's 'ema' teacher: it was written for "
                             "another model or adapter.")
        self._teacher_average.load_state_dict(pairs, saved)
