"""Start-up checks that fail before any model weights are loaded: data, tokenizers, vocabulary sizes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .config_checks import check_run_options
from .prompts import template_columns


def check_prompt_dataset(dataset, *, name: str = "train_dataset", required: dict[str, str] | None = None,
                         prompt_columns: tuple[str, ...] = ("prompt",)) -> None:
    """A prompt dataset must be non-empty and have a `prompt` column, and each column of `required` (column -> what
    the configuration needs it for). Every row of `prompt_columns` must be a prompt: a non-empty string or a
    non-empty list of chat messages."""
    if dataset is None:
        return
    columns = getattr(dataset, "column_names", None)
    for column, purpose in (required or {}).items():
        if columns is not None and column not in columns:
            raise ValueError(f"{name} has no {column!r} column (columns: {columns}), {purpose}.")
    if columns is not None and "prompt" not in columns:
        raise ValueError(
            f"{name} has no 'prompt' column (columns: {columns}). OPDTrainer reads prompts from 'prompt', as a string "
            "or a list of chat messages. Rename your column, e.g. `dataset.rename_column('question', 'prompt')`, or "
            "set `prompt_column: question` in a recipe."
        )
    try:
        size = len(dataset)
    except TypeError:  # an IterableDataset has no length; an empty stream surfaces when training starts
        return
    if size == 0:
        raise ValueError(f"{name} is empty: there are no prompts to sample completions for.")
    for column in prompt_columns:
        if columns is None or column in columns:
            for row, prompt in enumerate(dataset[column]):
                problem = prompt_problem(prompt)
                if problem:
                    raise ValueError(
                        f"{name} row {row}: its {column!r} {problem}. A prompt is a non-empty string or a non-empty "
                        "list of chat messages, each a dict with 'role' and 'content'."
                    )


def prompt_problem(prompt) -> str | None:
    """What is wrong with one prompt (text or chat messages), or None."""
    if isinstance(prompt, str):
        return "is an empty string" if not prompt.strip() else None
    if not isinstance(prompt, list):
        return f"is {type(prompt).__name__} {str(prompt)[:60]!r}"
    if not prompt:
        return "is an empty list of messages"
    for i, message in enumerate(prompt):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            return f"message {i} is not a dict with 'role' and 'content': {str(message)[:60]!r}"
    return None


def check_tokenizers_compatible(student_tokenizer, teacher_tokenizer, *, student_name: str, teacher_name: str) -> None:
    """The teacher must read every token id the student can write as the same token, with the same bos/eos.

    The teacher may know extra tokens (a larger vocabulary); it may not map any student id to another string.
    Padding tokens may differ: padding is never scored.
    """
    student_vocab = {index: token for token, index in student_tokenizer.get_vocab().items()}
    teacher_vocab = {index: token for token, index in teacher_tokenizer.get_vocab().items()}
    for index in sorted(student_vocab):
        if teacher_vocab.get(index) != student_vocab[index]:
            raise ValueError(
                f"The student ({student_name}) and teacher ({teacher_name}) tokenizers differ: token id {index} is "
                f"{student_vocab[index]!r} for the student and {teacher_vocab.get(index)!r} for the teacher. The "
                "teacher scores the student's token ids as they are, so both must share one vocabulary (e.g. two "
                "sizes of the same model family). For a teacher from another model family, set "
                "teacher_tokenizer_mode: cross (it scores the sampled text in its own tokens)."
            )
    for role in ("bos_token_id", "eos_token_id"):
        student_id, teacher_id = getattr(student_tokenizer, role), getattr(teacher_tokenizer, role)
        if student_id != teacher_id:
            raise ValueError(
                f"The student ({student_name}) and teacher ({teacher_name}) disagree on {role}: {student_id} vs "
                f"{teacher_id}. Use a teacher from the student's model family, align the special tokens, or set "
                "teacher_tokenizer_mode: cross (the teacher scores the sampled text in its own tokens)."
            )


def check_vocab_sizes(*, student_vocab_size: int, teacher_vocab_size: int, student_name: str, teacher_name: str):
    """The teacher's output layer must cover every id the student's output layer can sample."""
    if teacher_vocab_size < student_vocab_size:
        raise ValueError(
            f"The teacher ({teacher_name}) outputs {teacher_vocab_size} logits per token but the student "
            f"({student_name}) can sample {student_vocab_size} token ids, so some sampled tokens could not be scored. "
            "Use a teacher whose vocabulary is at least the student's."
        )


def check_opd_inputs(model, teacher_model, args, train_dataset, eval_dataset, reward_funcs, peft_config, *,
                     env_rewards=(), reward_processing_classes=None) -> None:
    """Everything that can be wrong with OPDTrainer's inputs, checked before any weights load. `env_rewards`: the
    environments' `get_reward`, which join `reward_funcs` in GRPO."""
    check_reward_processing_classes(reward_funcs, reward_processing_classes)
    reward_funcs = [*reward_funcs, *env_rewards]
    evals = eval_dataset.items() if isinstance(eval_dataset, dict) else [("", eval_dataset)]
    datasets = [("train_dataset", train_dataset)] + [(f"eval_dataset{k and f'[{k!r}]'}", d) for k, d in evals]
    required = {}
    if args.teacher_prompt_column:
        required[args.teacher_prompt_column] = "which teacher_prompt_column names as the prompt the teacher sees"
    templated = template_columns(args.teacher_prompt_template) if args.teacher_prompt_template else []
    for column in templated:
        required[column] = f"which teacher_prompt_template {args.teacher_prompt_template!r} reads"
    if args.teachers:
        required[args.teacher_route_column] = f"to route rows to teachers {sorted(args.teachers)}"
    prompt_columns = ("prompt", *([args.teacher_prompt_column] if args.teacher_prompt_column else []))
    for name, dataset in datasets:
        check_prompt_dataset(dataset, name=name, required=required, prompt_columns=prompt_columns)
        for column in templated if dataset is not None and hasattr(dataset, "__len__") else []:
            row = next((i for i, value in enumerate(dataset[column]) if value is None), None)
            if row is not None:
                raise ValueError(f"{name} row {row} has no {column!r} (None), which teacher_prompt_template "
                                 f"{args.teacher_prompt_template!r} reads. Fill it, or drop the rows without it.")
    if args.teachers:
        check_routes(datasets, args)
    from accelerate.utils import is_peft_model

    check_run_options(args, teacher_model=teacher_model, rewards=bool(reward_funcs),
                      peft=peft_config is not None or (not isinstance(model, str) and is_peft_model(model)))


def check_reward_processing_classes(reward_funcs: list, reward_processing_classes) -> None:
    """GRPO pairs `reward_processing_classes` with `reward_funcs` one to one: without reward functions it would pair
    them with OPD's placeholder reward, which the trainer drops (an environment's reward gets none of them)."""
    if reward_processing_classes is not None and not reward_funcs:
        raise ValueError("reward_processing_classes gives the tokenizers of reward models in reward_funcs, and no "
                         "reward_funcs were passed: pass the reward models too, or remove reward_processing_classes.")


def check_routes(datasets, args) -> None:
    """Every row must name a configured teacher in the routing column (which `check_prompt_dataset` requires)."""
    column = args.teacher_route_column
    for name, dataset in datasets:
        columns = getattr(dataset, "column_names", None)
        if dataset is None or columns is None:
            continue
        unknown = sorted(set(dataset[column]) - set(args.teachers))
        if unknown:
            raise ValueError(
                f"{name} routes rows to {unknown}, which are not among the configured teachers {sorted(args.teachers)}."
            )


# where a missing path is a build step not yet run: the command that builds it
_BUILDERS = {"artifacts/tiny_task": "make-tiny-task", "artifacts/tiny_agent": "make-tiny-agent"}


# what the Hub accepts as a repo id: `name` or `org/name`
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def _meant_as_path(path: str) -> bool:
    """A name that cannot be a Hub id, or whose first part is a folder here (`tiny/student` beside `tiny/`)."""
    parts = Path(path).parts
    return (path.startswith((".", "/", "~")) or not _HUB_ID.fullmatch(path) or ".." in path
            or (len(parts) > 1 and Path(parts[0]).is_dir()))


def _nearest_existing(path: str) -> str | None:
    """The existing path closest to a missing one: below its deepest existing folder, the entry nearest to the first
    missing part, with the rest of the path where that exists too."""
    import difflib

    missing = Path(path).expanduser()
    parent = missing.parent
    while not parent.exists():
        parent = parent.parent
    step, rest = missing.parts[len(parent.parts)], missing.parts[len(parent.parts) + 1:]
    close = difflib.get_close_matches(step, [entry.name for entry in parent.iterdir()], n=1, cutoff=0.6)
    if not close:
        return None
    whole = parent.joinpath(close[0], *rest)
    return str(whole if whole.exists() else parent / close[0])


def check_local_path(path, what: str) -> None:
    """A model or dataset named by a path that does not exist is a missing path or build step, not a Hub id: said
    now, with the nearest existing path, before anything loads. Models given as objects, and server URLs, pass."""
    if not isinstance(path, str) or not path or "://" in path or Path(path).expanduser().exists():  # a URL: served
        return
    if not _meant_as_path(path):
        from huggingface_hub import constants, try_to_load_from_cache

        if constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(path, "config.json"), str):
            raise FileNotFoundError(
                f"{what} {path!r} is neither a path here (relative paths are from {Path.cwd()}) nor, with "
                "HF_HUB_OFFLINE set, a Hub model in the local cache. Give the model's folder (e.g. an absolute "
                "path), or download it while online."
            )
        return
    builder = next((f"trl-opd {command} {directory}" for directory, command in _BUILDERS.items()
                    if directory in path), "trl-opd make-tiny artifacts/tiny" if "artifacts/" in path else None)
    nearest = _nearest_existing(path)
    raise FileNotFoundError(
        f"{what} {path!r} does not exist (relative paths are from {Path.cwd()})."
        + (f" Did you mean {nearest!r}?" if nearest else "")
        + (f" For the CPU recipes, build the tiny models first: `{builder}`." if builder else "")
    )


def check_weight_files(path, *, role: str) -> None:
    """A local model or adapter directory's weight files must be whole: each safetensors header is read (not the
    weights), so an empty or truncated file is named before loading starts."""
    import struct

    directory = Path(path) if isinstance(path, (str, Path)) else None
    if directory is None or not directory.is_dir():
        return
    for file in sorted(directory.glob("*.safetensors")):
        size = file.stat().st_size
        problem = None
        if size < 8:
            problem = f"is {size} bytes long"
        else:
            with open(file, "rb") as f:
                header = struct.unpack("<Q", f.read(8))[0]
                try:
                    meta = json.loads(f.read(header)) if 8 + header <= size else None
                except ValueError:
                    meta = None
            if meta is None:
                problem = "has an unreadable header"
            else:
                ends = [entry["data_offsets"][1] for name, entry in meta.items() if name != "__metadata__"]
                if 8 + header + max(ends, default=0) > size:
                    problem = f"is truncated ({size} bytes, its header describes {8 + header + max(ends)})"
        if problem:
            raise ValueError(f"The {role} weight file {file} {problem}: re-download or re-save it.")


def check_model_files(model, teacher_model, args) -> None:
    """`check_weight_files` on every local model directory the configuration names: the student, its teachers and
    the teacher's adapter."""
    check_local_path(model, "model")
    check_weight_files(model, role="student")
    teachers = args.teachers or {"teacher": teacher_model or args.teacher_model_name_or_path}
    for name, source in teachers.items():
        role = f"teacher {name!r}" if args.teachers else "teacher"
        check_local_path(source, role if args.teachers else "teacher_model" if teacher_model
                         else "teacher_model_name_or_path")
        check_weight_files(source, role=role)
    check_local_path(args.teacher_adapter_name_or_path, "teacher_adapter_name_or_path")
    check_weight_files(args.teacher_adapter_name_or_path, role="teacher adapter")


def check_chat_template(tokenizer, dataset, *, name: str, role: str = "student") -> None:
    """Chat prompts need a chat template to render them, which a base model's tokenizer may not have. `role`: whose
    tokenizer renders them (a cross-tokenizer teacher renders its own)."""
    if getattr(tokenizer, "chat_template", None) or dataset is None:
        return
    try:
        first = next(iter(dataset))["prompt"]
    except (StopIteration, KeyError, TypeError):
        return
    if isinstance(first, list):
        raise ValueError(
            f"{name}'s prompts are chat messages, but the {role}'s tokenizer "
            f"({getattr(tokenizer, 'name_or_path', None) or type(tokenizer).__name__}) has no chat "
            f"template to render them. Use an instruction-tuned {role}, give the tokenizer a chat_template, or use "
            "text prompts (prompt_as_user_message: false with a text column)."
        )


def check_head_projectable(student) -> None:
    """This package projects the student's LM head by its weight (the dense terms on every device, the loss's
    log-probs on a CPU), so PEFT's trainable tokens on it (`trainable_token_indices`) would be left out of those
    projections. (GRPO itself refuses a LoRA adapter on the head; `modules_to_save` trains it whole, which works.)"""
    from peft.utils.other import TrainableTokensWrapper

    head = student.get_output_embeddings()
    if isinstance(head, TrainableTokensWrapper):
        raise ValueError(
            "The student's LM head carries trainable tokens (trainable_token_indices), which the distillation terms "
            "would leave out: they project the head by its weight. Train the head whole with "
            "modules_to_save=['lm_head'], or leave the head out of trainable_token_indices."
        )
