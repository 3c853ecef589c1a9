"""The student as its own teacher (`student_as_teacher`): a local teacher whose model is the student's, read with the
weights its kind names.

Each kind is one model and one adapter setting, applied around the scoring pass only:
- 'initial': a PEFT student with its adapter as it started (GRPO's "ref" copy of a pretrained adapter, or the
  adapter switched off for a new one); a fully fine-tuned student's frozen copy (GRPO's reference model);
- 'live': the student as it is, without gradient (scoring runs under `no_grad`), no second copy of the weights;
- 'ema': a PEFT student's "ema" adapter, or the fully fine-tuned student's reference copy, which `TeacherEMA`
  moves towards the student after optimizer steps.

Scoring is `LocalTeacher`'s (the backbone once, the head in tiles, top-k tokens or hidden states kept for the dense
estimators), at the student's sampling temperature.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from accelerate.utils import is_peft_model
from trl.trainer.utils import use_adapter

from .base import TeacherScores
from .local import LocalTeacher

EMA_ADAPTER = "ema"


class StudentTeacher(LocalTeacher):
    """`LocalTeacher` over `model_fn()` (the trainer's model now: the student, or its reference copy), scored with
    `adapter` active: an adapter's name, None for all adapters off, or `LIVE` to leave the student as it is."""

    LIVE = "live"

    def __init__(self, model_fn: Callable[[], torch.nn.Module], *, adapter: str | None, **kwargs):
        super().__init__(model_fn(), **kwargs)
        self.model_fn, self.adapter = model_fn, adapter

    @property
    def causal_lm(self) -> torch.nn.Module:
        """The transformers model under any DeepSpeed, accelerate or PEFT wrapper (adapter layers stay in it)."""
        model = getattr(self.model, "module", self.model)
        return model.get_base_model() if is_peft_model(model) else model

    def _weights(self) -> AbstractContextManager:
        model = getattr(self.model, "module", self.model)
        if self.adapter == self.LIVE or not is_peft_model(model):
            return nullcontext()
        return use_adapter(model, adapter_name=self.adapter)

    @torch.no_grad()
    def score(self, prompt_ids, prompt_mask, completion_ids, completion_mask) -> TeacherScores:
        """`LocalTeacher.score` with the kind's weights, in eval mode: a teacher scores without dropout whatever the
        student trains with (the 'ema' adapter's own dropout layers are new, so GRPO's `disable_dropout` never saw
        them)."""
        self.model = self.model_fn()  # the trainer's model may have been wrapped since the last call
        training = self.model.training
        self.model.eval()
        try:
            with self._weights():
                return super().score(prompt_ids, prompt_mask, completion_ids, completion_mask)
        finally:
            self.model.train(training)


def add_ema_adapter(model) -> None:
    """Give a PEFT student an `EMA_ADAPTER` adapter equal to its "default" one, frozen (the 'ema' kind's teacher).
    Its initial values are overwritten, so drawing them leaves the run's random stream (its samples) untouched."""
    with torch.random.fork_rng(devices=[]):
        model.add_adapter(EMA_ADAPTER, model.peft_config["default"])
    for name, param in model.named_parameters():
        if ".default." in name:
            copy = model.get_parameter(name.replace(".default.", f".{EMA_ADAPTER}."))
            copy.data.copy_(param.data)
            copy.requires_grad_(False)


def ema_pairs(student: torch.nn.Module, teacher: torch.nn.Module | None) -> dict[str, tuple[torch.nn.Parameter, ...]]:
    """The (teacher, student) parameter pairs the 'ema' kind averages, by the teacher parameter's name: a PEFT
    student's "ema" and "default" adapter weights, or a fully fine-tuned student's reference copy and its own."""
    if teacher is None:  # PEFT: the adapters live in the student
        return {name.replace(".default.", f".{EMA_ADAPTER}."): (
                    student.get_parameter(name.replace(".default.", f".{EMA_ADAPTER}.")), param)
                for name, param in student.named_parameters() if ".default." in name}
    own = dict(student.named_parameters())
    pairs = {name: (param, own.get(name)) for name, param in teacher.named_parameters()}
    if len(pairs) != len(own) or any(param is None for _, param in pairs.values()):
        raise ValueError("The reference copy's parameters are not the student's, so it cannot follow the student.")
    return pairs


@torch.no_grad()
def ema_update(pairs, rate: float, *, zero3: bool = False) -> None:
    """teacher <- teacher + rate * (student - teacher) for each of `ema_pairs`. Under ZeRO-3 each parameter is
    partitioned across processes: both are gathered, rank 0 updates, and the new value is partitioned back."""
    def update():
        for teacher, student in pairs.values():
            teacher.lerp_(student.to(teacher.dtype), rate)

    if not zero3:
        update()
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters([param for pair in pairs.values() for param in pair], modifier_rank=0):
        if deepspeed.comm.get_rank() == 0:
            update()
