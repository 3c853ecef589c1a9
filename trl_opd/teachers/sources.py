"""The teacher sources: what each supports (its `SUPPORT`, declared beside its scorer), and the scorer the trainer
calls, built from them.

The option checks read `source_support`; nothing else in the package matches a source by name to decide what it can
do. docs/development.md lists the files that adding a source touches.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..loss import shared_temperature
from . import local, reference, routed, student, vllm_server
from .base import SourceSupport, TeacherScorer
from .cross import CrossTokenizerTeacher
from .local import LocalTeacher, freeze_teacher
from .reference import ReferenceTeacher
from .routed import RoutedTeacher
from .student import self_teacher
from .vllm_server import is_served

SOURCES: dict[str, SourceSupport] = {support.name: support for support in (
    local.SUPPORT, vllm_server.SUPPORT, reference.SUPPORT, student.SUPPORT, routed.SUPPORT)}


def source_support(args, teacher_model=None) -> SourceSupport | None:
    """What the teacher source of `args` (and `teacher_model`, what the trainer was given) supports; None while no
    source is known. Routed teachers support together what each of them does."""
    name = args.teacher_source(teacher_model)
    if name != "routed":
        return SOURCES.get(name)
    members = [vllm_server.SUPPORT if is_served(teacher) else local.SUPPORT for teacher in args.teachers.values()]
    loaded = [member for member in members if member.not_loaded is None]
    return replace(
        routed.SUPPORT,
        estimators=tuple(e for e in routed.SUPPORT.estimators if all(e in member.estimators for member in members)),
        off_trainer=all(member.off_trainer for member in members),
        own_tokenizer=all(member.own_tokenizer for member in members),
        not_loaded=None if loaded else "every routed teacher is served (each server's options set its dtype)",
        option="routed teachers with a local model (teachers)" if loaded else routed.SUPPORT.option,
    )


def build_scorer(trainer, teachers: dict) -> tuple[TeacherScorer, dict[str, torch.nn.Module]]:
    """The scorer `trainer` calls, for its plan's teacher source, and the local teacher models it holds, by name (a
    single teacher is "teacher"), frozen and placed once the accelerator exists (`trainer._prepare_teacher`).
    `teachers` is what `loading.load_teachers` gave: models and connected server clients, by name."""
    args = trainer.args
    models = {name: trainer._prepare_teacher(freeze_teacher(teacher))
              for name, teacher in teachers.items() if isinstance(teacher, torch.nn.Module)}
    source, estimator = trainer.plan.teacher_source, trainer.plan.estimator
    if source == "reference":
        return ReferenceTeacher(trainer._reference_logps), models
    student = trainer._student_causal_lm()
    student_vocab_size = student.config.get_text_config().vocab_size
    scoring = dict(batch_size=args.teacher_batch_size or args.per_device_train_batch_size,
                   autocast=trainer.accelerator.autocast, return_hidden=estimator == "full",
                   topk=args.opd_topk if estimator == "topk" else 0, student_vocab_size=student_vocab_size)
    if source == "self":  # at the student's sampling temperature, so that it starts equal to its teacher
        scorers = {"teacher": self_teacher(args.student_as_teacher, trainer.accelerator.unwrap_model(trainer.model),
                                           trainer.model, trainer.ref_model, temperature=trainer.temperature,
                                           **scoring)}
    else:
        scorers = {name: LocalTeacher(models[name], temperature=args.teacher_temperature, **scoring)
                   if name in models else teacher for name, teacher in teachers.items()}
    if estimator == "topk" and args.opd_topk > student_vocab_size:
        raise ValueError(f"opd_topk={args.opd_topk} exceeds the student's vocabulary of {student_vocab_size} "
                         "tokens: the top-k term compares at most that many. Lower opd_topk.")
    for scorer in scorers.values() if estimator == "full" else ():  # a pair the kernel cannot apply
        shared_temperature(trainer._student_head(student), scorer.output_head)
    if args.teacher_tokenizer_mode == "cross":  # each teacher reads the sampled text its own way
        scorers = {
            name: CrossTokenizerTeacher(
                scorer, student_tokenizer=trainer._tokenizer, teacher_tokenizer=trainer.teacher_tokenizers[name],
                stop_ids=trainer.eos_token_ids, tools=trainer.tools, chat_template_kwargs=trainer.chat_template_kwargs,
                credit=args.teacher_cross_credit or "byte",
            ) for name, scorer in scorers.items()
        }
    if source != "routed":
        return scorers["teacher"], models
    # ZeRO-3's and FSDP2's forwards are collectives: every rank runs each sharded teacher as often
    sharded = tuple(models) if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled else ()
    return RoutedTeacher(scorers, collective=sharded, max_over_ranks=trainer._max_over_ranks), models
