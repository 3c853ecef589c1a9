"""Turn what the user configured into a teacher, checking the student/teacher pair before any weights load."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer
from trl.trainer.utils import create_model_from_path, get_config_model_id

from ..alignment import ByteVocabulary
from ..checks import check_tokenizers_compatible, check_vocab_sizes
from ..models_dir import resolve_model
from ..secrets import mask_urls
from .served_hidden import HiddenStateTeacher, all_hidden, load_teacher_head, server_infos
from .vllm_server import VLLMServerTeacher, is_served


def load_local_teacher(teacher, args, *, student, student_name: str, student_tokenizer, teacher_tokenizer=None):
    """Check the pair fits (tokenizers, vocabulary sizes, adapter base) from configs alone, then load the teacher.

    `teacher` is a path/Hub id or a model. With `args.teacher_adapter_name_or_path`, the adapter is loaded onto it
    and merged, so scoring runs one plain model.
    """
    remote = args.trust_remote_code
    teacher_name = teacher if isinstance(teacher, str) else get_config_model_id(teacher.config)
    if args.teacher_tokenizer_mode == "same":  # a cross-tokenizer teacher's tokenizer is checked on its own
        if teacher_tokenizer is None and teacher_name:
            teacher_tokenizer = AutoTokenizer.from_pretrained(teacher_name, trust_remote_code=remote)
        check_tokenizers_compatible(
            student_tokenizer,
            getattr(teacher_tokenizer, "tokenizer", teacher_tokenizer) or student_tokenizer,
            student_name=student_name,
            teacher_name=teacher_name,
        )

        check_vocab_sizes(
            student_vocab_size=_vocab_size(student, args), teacher_vocab_size=_vocab_size(teacher, args),
            student_name=student_name, teacher_name=teacher_name,
        )
    adapter = args.teacher_adapter_name_or_path
    if adapter is not None:
        check_adapter_base(adapter, teacher_name)
    if isinstance(teacher, str):
        init_kwargs = dict(args.teacher_model_init_kwargs or {})
        init_kwargs.setdefault("trust_remote_code", remote)
        if "dtype" not in init_kwargs and "torch_dtype" not in init_kwargs:  # the student's, unless told otherwise
            student_dtype = (student.dtype if isinstance(student, torch.nn.Module)
                             else (args.model_init_kwargs or {}).get("dtype"))
            if student_dtype is not None:
                init_kwargs["dtype"] = student_dtype
        if args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
            init_kwargs["device_map"] = None  # "auto" fails under distributed training
        teacher = create_model_from_path(teacher, **init_kwargs)
    if adapter is not None:
        from peft import PeftModel

        teacher = PeftModel.from_pretrained(teacher, adapter).merge_and_unload()
    return teacher


def check_adapter_base(adapter: str, teacher_name: str) -> None:
    """A teacher adapter must exist and have been trained on the teacher's base model."""
    config_file = Path(adapter) / "adapter_config.json"
    if not config_file.exists():
        raise FileNotFoundError(
            f"teacher_adapter_name_or_path {adapter!r} has no adapter_config.json: give the directory a PEFT adapter "
            "was saved to (`model.save_pretrained(...)` on a PeftModel)."
        )
    base = json.loads(config_file.read_text()).get("base_model_name_or_path")

    def same(a: str, b: str) -> bool:
        local = os.path.exists(a) and os.path.exists(b)
        return os.path.realpath(a) == os.path.realpath(b) if local else a.rstrip("/") == b.rstrip("/")

    if base and teacher_name and not same(base, teacher_name):
        raise ValueError(
            f"The teacher adapter {adapter!r} was trained on {base!r}, but the teacher base model is "
            f"{teacher_name!r}. Load it onto the model it was trained on (set teacher_model_name_or_path to {base!r})."
        )


def load_cross_tokenizers(teacher_model, args, *, student_tokenizer, teacher_tokenizer=None) -> dict:
    """Each teacher's own tokenizer, for teacher_tokenizer_mode 'cross', by teacher name ("teacher" for a single
    one): `teacher_tokenizer` if given, else teacher_tokenizer_name_or_path (one for all, or by name), else the local
    teacher's. Both sides are checked to give text back byte for byte, before any weights load."""
    ByteVocabulary.of(student_tokenizer).check_lossless(role="student")
    given = args.teacher_tokenizer_name_or_path
    tokenizers = {}
    for route, teacher in teacher_sources(teacher_model, args).items():
        tokenizer = teacher_tokenizer
        if tokenizer is None:
            name = given.get(route) if isinstance(given, dict) else given
            if name is None and isinstance(teacher, str) and not is_served(teacher):
                name = teacher
            elif name is None and hasattr(teacher, "config"):
                name = get_config_model_id(teacher.config)
            if not name:
                raise ValueError(
                    "teacher_tokenizer_mode 'cross' needs the teacher's tokenizer: set teacher_tokenizer_name_or_path "
                    "to the teacher's path or Hub id (for a served teacher, the served model's), or pass "
                    "teacher_processing_class."
                )
            tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=args.trust_remote_code)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        ByteVocabulary.of(tokenizer).check_lossless(role="teacher" if route == "teacher" else f"teacher {route!r}")
        tokenizers[route] = tokenizer
    return tokenizers


def _served_topk(args) -> int:
    """How many of the teacher's most likely tokens a served teacher must send per position: the topk estimator's k,
    or, for a cross-tokenizer teacher with the byte credit, those the credit reads (asked already by the start-up
    probe, so that a server allowing fewer is refused before training)."""
    if args.opd_estimator == "topk":
        return args.opd_topk
    if args.byte_credit:
        from .byte_credit import SERVED_EXTENSION_TOPK

        return SERVED_EXTENSION_TOPK
    return 0


def connect_served_teacher(urls, args, *, student_tokenizer, student_name: str, teacher_tokenizer=None,
                           student=None) -> VLLMServerTeacher:
    """A client for the teacher servers at `urls`, checked for health and tokenizer agreement: with the student's
    tokenizer, or with `teacher_tokenizer` (a cross-tokenizer teacher). Servers that return hidden states get a
    `HiddenStateTeacher` with the teacher's head (`served_hidden`); `student` (path or model) sizes its vocabulary."""
    infos = server_infos(urls, args)
    hidden = all_hidden(infos)
    if not hidden and args.opd_estimator == "full":
        raise ValueError(
            f"opd_estimator='full' with a served teacher needs its final hidden states, and {mask_urls(str(urls))} "
            "gives log-probs only: start it with `trl-opd serve-teacher MODEL --hidden-states`, or use "
            "opd_estimator: topk."
        )
    if hidden and teacher_tokenizer is not None:
        raise ValueError("teacher_tokenizer_mode 'cross' reads a served teacher's log-probs: start its server "
                         "without --hidden-states.")
    if not hidden and args.teacher_temperature != 1.0:
        raise ValueError(
            "teacher_temperature applies to a teacher whose head is here (local, or served with --hidden-states): a "
            "vLLM log-prob server returns raw log-probs and cannot renormalise them at another temperature. Serve "
            "the teacher locally or with --hidden-states, or keep teacher_temperature at 1."
        )
    client = dict(
        api_key_env=args.teacher_server_api_key_env,
        batch_size=args.teacher_batch_size or args.per_device_train_batch_size,
        timeout=(10.0, args.teacher_server_timeout),
        max_retries=args.teacher_server_max_retries,
        topk=_served_topk(args),
        startup_timeout=args.teacher_server_startup_timeout,
    )
    if hidden:
        served_model = next(iter(infos.values()))["model"]
        teacher = HiddenStateTeacher.from_env(urls, **client, **_served_head(served_model, args, student, student_name))
    else:
        teacher = VLLMServerTeacher.from_env(urls, **client)
    if teacher_tokenizer is not None:
        teacher.connect(teacher_tokenizer, student_name=teacher_tokenizer.name_or_path, cross_tokenizer=True)
    else:
        teacher.connect(student_tokenizer, student_name=student_name)
    return teacher


def _served_head(served_model: str, args, student, student_name: str) -> dict:
    """`HiddenStateTeacher`'s head and options: the head read from teacher_model_name_or_path (else `served_model`,
    the served model's own name, when it is a path or Hub id readable here), in the teacher's dtype as a local one
    would load."""
    name = None if is_served(args.teacher_model_name_or_path) else args.teacher_model_name_or_path
    name = resolve_model(name or served_model)
    dtype = (args.teacher_model_init_kwargs or {}).get("dtype") or (
        student.dtype if isinstance(student, torch.nn.Module) else (args.model_init_kwargs or {}).get("dtype"))
    dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
    head = load_teacher_head(name, dtype=None if dtype == "auto" else dtype, device=args.device,
                             temperature=args.teacher_temperature, trust_remote_code=args.trust_remote_code)
    vocab_size = _vocab_size(student, args)
    check_vocab_sizes(student_vocab_size=vocab_size, teacher_vocab_size=head.vocab_size, student_name=student_name,
                      teacher_name=name)
    return {"head": head, "return_hidden": args.opd_estimator == "full", "student_vocab_size": vocab_size}


def _vocab_size(model, args) -> int:
    config = (AutoConfig.from_pretrained(model, trust_remote_code=args.trust_remote_code) if isinstance(model, str)
              else model.config)
    return config.get_text_config().vocab_size


def teacher_sources(teacher_model, args) -> dict:
    """name -> what the user gave for each teacher (a model, a path/Hub id, server URLs): "teacher" for a single one,
    the routed names for `teachers`; empty for the reference and student-base teachers."""
    teacher_model = args.teacher_model_name_or_path if teacher_model is None else teacher_model
    if args.teacher_server_url:
        return {"teacher": args.teacher_server_url}
    if teacher_model is not None:
        return {"teacher": teacher_model}
    return dict(args.teachers or {})


def load_teachers(model, teacher_model, args, *, student_name, student_tokenizer, teacher_tokenizer) -> dict:
    """name -> loaded local teacher model or connected server client, checked against the student. Empty for the
    reference and student-base teachers, which are the student's own weights. `teacher_tokenizer`: the user's
    teacher tokenizer (same mode), or each teacher's by name (`load_cross_tokenizers`, cross mode)."""
    cross = args.teacher_tokenizer_mode == "cross"
    sources = teacher_sources(teacher_model, args)
    for name, source in sources.items():
        tokenizer = teacher_tokenizer[name] if cross else teacher_tokenizer
        if is_served(source):
            sources[name] = connect_served_teacher(
                source, args, student_tokenizer=student_tokenizer, student_name=student_name,
                teacher_tokenizer=tokenizer if cross else None, student=model,
            )
        else:
            sources[name] = load_local_teacher(
                source, args, student=model, student_name=student_name, student_tokenizer=student_tokenizer,
                teacher_tokenizer=tokenizer,
            )
    return sources
