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
from torch.distributed.tensor import DTensor, Shard
from trl.trainer.utils import use_adapter

from ..heads import OutputHead
from .base import SourceSupport, TeacherScores
from .local import LocalTeacher

EMA_ADAPTER = "ema"


def _describe(args) -> str:
    weights = {"initial": "initial", "live": "current", "ema": "moving-average"}[args.student_as_teacher]
    return f"the student itself, with its {weights} weights (student_as_teacher: {args.student_as_teacher})"


SUPPORT = SourceSupport(
    name="self",
    chooses=("student_as_teacher",),
    option="student_as_teacher",
    estimators=("sampled", "topk", "full"),
    off_trainer=False,
    own_tokenizer=False,
    teacher_temperature=False,
    not_loaded="student_as_teacher's teacher is the student's own weights, in its dtype",
    default_estimator="full",
    returns="as a local teacher, from the student's own weights of its kind",
    describe=_describe,
)

class StudentTeacher(LocalTeacher):
    """`LocalTeacher` over `model_fn()` (the trainer's model now: the student, or its reference copy), scored with
    `adapter` active: an adapter's name, None for all adapters off, or `LIVE` to leave the student as it is."""

    LIVE = "live"

    def __init__(self, model_fn: Callable[[], torch.nn.Module], *, adapter: str | None, **kwargs):
        super().__init__(model_fn(), **kwargs)
        self.model_fn, self.adapter = model_fn, adapter
        self._head: OutputHead | None = None  # the head of the last scoring pass

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
                self._head = self._read_head()  # with the kind's weights active, and kept for the loss
                return super().score(prompt_ids, prompt_mask, completion_ids, completion_mask)
        finally:
            self.model.train(training)

    @property
    def output_head(self) -> OutputHead:
        """The head that scored: read with the kind's weights active (a PEFT student's head under `modules_to_save`
        is one copy per adapter, the starting one with adapters off), and kept, since the loss projects the kept
        hidden states through it while the student's own adapter, and head, are active."""
        if self._head is None:
            with self._weights():
                self._head = self._read_head()
        return self._head

    def _read_head(self) -> OutputHead:
        return OutputHead.of(self.causal_lm, temperature=self.temperature)


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


def _gathered(params, *, modify: bool, zero3: bool) -> AbstractContextManager:
    """`params` whole on every process inside the block (ZeRO-3 partitions them outside a forward); with `modify`, what
    process 0 writes into them is partitioned back on leaving it."""
    if not zero3:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modify else None)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """What this process holds of `tensor`, to read or write in place: an FSDP2 parameter's shard, else all of it."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor.data


def _held_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of `value` (whole, or an FSDP2 DTensor) that this process holds of `like`: under FSDP2 a student and
    its teacher copy are sharded alike (each parameter in dim-0 chunks over the processes) once both are placed, and
    a parameter not yet placed (the student before the Trainer prepares it) is whole."""
    if isinstance(value, DTensor):
        if isinstance(like, DTensor) and (value.device_mesh, value.placements) == (like.device_mesh, like.placements):
            return value.to_local()
        value = value.full_tensor()  # a collective
    if not isinstance(like, DTensor):
        return value
    if like.placements != (Shard(0),):
        raise ValueError(f"A teacher copy sharded as {like.placements}: FSDP2's dim-0 shards are the supported kind.")
    chunks = value.chunk(like.device_mesh.size(), dim=0)  # DTensor's own split
    rank = like.device_mesh.get_local_rank()
    return chunks[rank] if rank < len(chunks) else value[:0]


@torch.no_grad()
def copy_parameters(pairs, *, zero3: bool = False) -> None:
    """teacher <- student for each (teacher, student) pair of `ema_pairs`, one parameter gathered at a time (under
    FSDP2, each process writes its own shard)."""
    for teacher, student in pairs.values():
        with _gathered([student], modify=False, zero3=zero3), _gathered([teacher], modify=True, zero3=zero3):
            _local(teacher).copy_(_held_like(student, teacher))


def self_teacher(kind: str, student, model, ref_model, **scoring) -> StudentTeacher:
    """The scorer of `student_as_teacher`'s `kind`, over the model that holds its weights: the student's `model`
    (GRPO's, wrapped; `student` is it unwrapped), with the adapter of that kind, or GRPO's reference copy."""
    if kind == "live":
        return StudentTeacher(lambda: model, adapter=StudentTeacher.LIVE, **scoring)
    if is_peft_model(student):
        initial = "ref" if "ref" in student.peft_config else None  # a pretrained adapter's copy, else none
        return StudentTeacher(lambda: model, adapter=EMA_ADAPTER if kind == "ema" else initial, **scoring)
    return StudentTeacher(lambda: ref_model, adapter=None, **scoring)


class TeacherAverage:
    """The 'ema' kind's moving average, `teacher <- teacher + rate * (student - teacher)`, kept in float32 whatever
    the teacher copy's dtype: a bf16 copy updated in its own dtype loses every step below half a unit in the last
    place (at rate 0.05, most of them), and its norm weights would never move. The copy the teacher scores with is
    the average rounded to its dtype.

    Memory: a float32 teacher on one process is its own average (nothing more is held); any other teacher holds 4
    bytes per averaged parameter beside it, divided among the processes under ZeRO-3, where each process keeps the
    average of its 1/N slice of every parameter (gathered one parameter at a time to update, and its rounded slices
    gathered back into the teacher), and under FSDP2, where each process averages its own shard. Each call takes the
    (teacher, student) pairs of `ema_pairs` as they are now (under FSDP2 the Trainer places the student's
    parameters, an adapter's included, after this average began)."""

    def __init__(self, pairs: dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter]], *, zero3: bool = False):
        self.zero3 = zero3
        self.rank, self.world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if zero3 else (0, 1)
        # name -> this process's float32 slice of the average; None where the float32 teacher is its own average
        self.average: dict[str, torch.Tensor | None] = {}
        for name, (teacher, _) in pairs.items():
            in_place = teacher.dtype == torch.float32 and self.world == 1
            with _gathered([teacher], modify=False, zero3=zero3):
                self.average[name] = None if in_place else self._own(teacher).float().clone()

    def _own(self, tensor: torch.Tensor) -> torch.Tensor:
        """This process's slice of a whole tensor under ZeRO-3, a 1/N slice of it flattened (the last one padded
        with zeros); else what this process holds of it (all of it, or its FSDP2 shard)."""
        if self.world == 1:
            return _local(tensor)
        size = -(-tensor.numel() // self.world)
        flat = torch.nn.functional.pad(tensor.data.flatten(), (0, size * self.world - tensor.numel()))
        return flat[self.rank * size : (self.rank + 1) * size]

    def _whole(self, average: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Every process's slice of `average`, in `dtype`, as one tensor of `shape` (a collective under ZeRO-3)."""
        if self.world == 1:
            return average.to(dtype)
        slices = [torch.empty_like(average, dtype=dtype) for _ in range(self.world)]
        torch.distributed.all_gather(slices, average.to(dtype))
        return torch.cat(slices)[: shape.numel()].view(shape)

    def _check(self, pairs) -> None:
        if pairs.keys() != self.average.keys():
            raise ValueError("The 'ema' teacher's parameters changed since its average was started.")
        for name, (teacher, _) in pairs.items():  # a teacher sharded by FSDP2 since: its average becomes its shard's
            average = self.average[name]
            if self.world == 1 and average is not None and average.shape != _local(teacher).shape:
                self.average[name] = _held_like(average, teacher).clone()

    def _student_part(self, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        """What of `student` this process averages into its part of `teacher`."""
        return self._own(student) if self.world > 1 else _held_like(student, teacher)

    @torch.no_grad()
    def update(self, pairs, rate: float) -> None:
        """Move the average `rate` of the way towards the student, and the teacher to the average."""
        self._check(pairs)
        for name, (teacher, student) in pairs.items():
            with (_gathered([student], modify=False, zero3=self.zero3),
                  _gathered([teacher], modify=True, zero3=self.zero3)):
                average, toward = self.average[name], self._student_part(student, teacher).to(torch.float32)
                if average is None:
                    _local(teacher).lerp_(toward, rate)
                    continue
                average.lerp_(toward, rate)
                _local(teacher).copy_(self._whole(average, teacher.shape, teacher.dtype))

    @torch.no_grad()
    def state_dict(self, pairs) -> dict[str, torch.Tensor]:
        """The whole float32 average by the teacher parameters' names, on the CPU (a collective under ZeRO-3)."""
        self._check(pairs)
        state = {}
        for name, (teacher, _) in pairs.items():
            average = self.average[name]
            if isinstance(teacher, DTensor):  # each process's shard of the average, whole (a collective)
                shard = _local(teacher) if average is None else average
                whole = DTensor.from_local(shard, teacher.device_mesh, teacher.placements, shape=teacher.shape,
                                           stride=teacher.stride()).full_tensor()
                state[name] = whole.float().cpu().clone()
                continue
            if average is None:
                state[name] = teacher.detach().cpu().clone()
                continue
            shape = torch.Size(getattr(teacher, "ds_shape", teacher.shape))  # whole, also while ZeRO-3 partitions it
            state[name] = self._whole(average, shape, torch.float32).cpu().clone()
        return state

    @torch.no_grad()
    def load_state_dict(self, pairs, saved: dict[str, torch.Tensor]) -> None:
        """Restore a saved average (`state_dict`; an earlier version saved the teacher's own weights, read the same
        way)."""
        self._check(pairs)
        for name, (teacher, _) in pairs.items():
            with _gathered([teacher], modify=True, zero3=self.zero3):
                _local(teacher).copy_(_held_like(saved[name], teacher).to(teacher.device, teacher.dtype))
            if self.average[name] is not None:
                value = saved[name].to(self.average[name].device, torch.float32)
                self.average[name].copy_(self._own(value) if self.world > 1 else _held_like(value, teacher))
