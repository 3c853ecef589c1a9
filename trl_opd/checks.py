"""Start-up checks that fail before any model weights are loaded: data, tokenizers, vocabulary sizes."""

from __future__ import annotations

import json
from pathlib import Path

from .prompts import template_columns
from .teachers.vllm_server import is_served


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
    other_sources = args.teacher_server_url or args.ref_as_teacher or args.student_as_teacher or args.teachers
    if teacher_model is not None and other_sources:
        raise ValueError("Pass a teacher model or set another teacher source in the OPDConfig, not both.")
    if args.teacher_source(teacher_model) is None:
        raise ValueError(
            "OPDTrainer needs a teacher: pass `teacher_model=` (a path or a model), or set one of "
            "`teacher_model_name_or_path`, `teacher_server_url`, `teachers`, `ref_as_teacher` or "
            "`student_as_teacher`."
        )
    if (args.ref_as_teacher or args.student_as_teacher) and args.teacher_temperature != 1.0:
        raise ValueError(
            "teacher_temperature does not apply to ref_as_teacher / student_as_teacher: the student as its own "
            "teacher scores at its sampling `temperature`, so that it starts equal to its teacher."
        )
    if args.ref_as_teacher and args.sync_ref_model:
        raise ValueError(
            "sync_ref_model moves GRPO's reference model towards the student, and ref_as_teacher reads that "
            "reference as the teacher: the teacher would drift to the student. Remove sync_ref_model; for a "
            "teacher that follows the student, use student_as_teacher: ema."
        )
    if args.teachers:
        check_routes(datasets, args)
    elif args.teacher_route_column != "teacher":
        raise ValueError(f"teacher_route_column={args.teacher_route_column!r} routes rows among `teachers`, and "
                         "none are set. Remove it, or set teachers.")
    check_options_apply(args, has_rewards=bool(reward_funcs))
    check_teacher_loading(teacher_model, args)
    if args.student_as_teacher:
        from accelerate.utils import is_peft_model

        check_self_teacher(args, has_rewards=bool(reward_funcs),
                           peft=peft_config is not None or (not isinstance(model, str) and is_peft_model(model)))
    if args.fsdp or args.distributed_state.distributed_type == "FSDP":
        raise ValueError(
            "FSDP is not supported: the dense estimators and sharded teachers are built and tested on DeepSpeed "
            "ZeRO-3, which shards the student and the teacher across processes and runs every estimator and teacher "
            "source. Launch with a ZeRO-3 config (recipes/accelerate/zero3.yaml), or use DDP or one process."
        )
    if reward_funcs and args.num_generations < 2:
        raise ValueError(
            "Reward functions need groups of completions per prompt (GRPO normalises rewards within a group): "
            f"set num_generations >= 2 (got {args.num_generations})."
        )


def check_reward_processing_classes(reward_funcs: list, reward_processing_classes) -> None:
    """GRPO pairs `reward_processing_classes` with `reward_funcs` one to one: without reward functions it would pair
    them with OPD's placeholder reward, which the trainer drops (an environment's reward gets none of them)."""
    if reward_processing_classes is not None and not reward_funcs:
        raise ValueError("reward_processing_classes gives the tokenizers of reward models in reward_funcs, and no "
                         "reward_funcs were passed: pass the reward models too, or remove reward_processing_classes.")


def check_options_apply(args, *, has_rewards: bool) -> None:
    """Every OPD option set must act on this configuration: a run that ignores one, or has no signal to learn from,
    is refused before anything loads, never trained with healthy-looking metrics."""
    sampled_term = args.opd_coef != 0.0
    dense_term = args.opd_estimator != "sampled" and args.opd_dense_coef != 0.0  # None resolves to 1.0 there
    if not (sampled_term or dense_term or has_rewards):
        raise ValueError(
            f"Nothing to learn from: opd_coef is 0 (no sampled-token term) and opd_estimator={args.opd_estimator!r} "
            f"{'has no dense term' if args.opd_estimator == 'sampled' else 'has opd_dense_coef 0'}, with no reward "
            "functions. Set opd_coef > 0, or a dense estimator ('topk', 'full') with opd_dense_coef > 0."
        )
    if not sampled_term:
        for option, active in (("opd_objective='importance_sampling'", args.opd_objective == "importance_sampling"),
                               (f"kl_discount_factor={args.kl_discount_factor}", args.kl_discount_factor > 0.0)):
            if active:
                raise ValueError(
                    f"{option} shapes the sampled-token term, which opd_coef=0 switches off (the default with "
                    f"opd_estimator={args.opd_estimator!r}). Set opd_coef > 0 to add that term, or remove the option."
                )
    if not sampled_term and not has_rewards:
        # every advantage is 0: GRPO's options that shape its policy-gradient term would multiply nothing
        for option, active in (
                (f"top_entropy_quantile={args.top_entropy_quantile}", args.top_entropy_quantile < 1.0),
                (f"off_policy_mask_threshold={args.off_policy_mask_threshold}",
                 args.off_policy_mask_threshold is not None),
                (f"delta={args.delta}", args.delta is not None),
                (f"importance_sampling_level={args.importance_sampling_level!r}",
                 args.importance_sampling_level != "token")):
            if active:
                raise ValueError(
                    f"{option} shapes GRPO's policy-gradient term, which has nothing to act on here: opd_coef is 0 "
                    f"(no sampled-token term) and there are no reward functions, so every advantage is 0 and the "
                    f"dense term of opd_estimator={args.opd_estimator!r} is the whole objective. Set opd_coef > 0 to "
                    "add the sampled-token term (the option then shapes it), add reward functions, or remove the "
                    "option."
                )
    if args.opd_divergence_beta != 1.0 and not dense_term:
        raise ValueError(
            f"opd_divergence_beta={args.opd_divergence_beta} chooses the dense term's divergence, and "
            f"opd_estimator={args.opd_estimator!r} has none (or opd_dense_coef is 0). The sampled-token term is the "
            "reverse KL's estimate from the student's own samples: a forward KL or JSD would need the teacher's "
            "distribution, which only 'topk' and 'full' compare. Use one of those, or leave the beta at 1."
        )
    if has_rewards and args.opd_skip_first_tokens:
        raise ValueError(
            f"opd_skip_first_tokens={args.opd_skip_first_tokens} leaves tokens out of the teacher's terms, and with "
            "reward functions GRPO's objective shares the mask of the tokens it trains: they would leave the reward's "
            "term too. Remove it, or train on the teacher alone."
        )
    if not has_rewards and args.opd_reward_combination != "loss":
        raise ValueError(
            f"opd_reward_combination={args.opd_reward_combination!r} says how reward functions combine with the "
            "teacher, and there are none. Remove it, or add reward_funcs."
        )
    if not has_rewards and args.opd_loss_coef != 1.0:
        raise ValueError(
            f"opd_loss_coef={args.opd_loss_coef} weighs the teacher against reward functions, and there are none: the "
            "teacher is the whole objective. Scale it with opd_coef / opd_dense_coef, or add reward_funcs."
        )
    if has_rewards and args.opd_objective == "importance_sampling" and args.opd_reward_combination == "advantage":
        raise ValueError(
            "opd_objective='importance_sampling' unclips the teacher's objective only, and with "
            "opd_reward_combination='advantage' the reward and teacher advantages share one clipped objective. Use "
            "opd_reward_combination='loss' (GRPO's clipped loss for the rewards, the unclipped one for the teacher)."
        )


def check_self_teacher(args, *, has_rewards: bool, peft: bool) -> None:
    """What `student_as_teacher` needs to teach anything, and what its 'ema' copy must not share."""
    kind = args.student_as_teacher
    if not args.teacher_own_prompt and kind == "live":
        raise ValueError(
            "student_as_teacher: live with no teacher context is the student itself reading the same prompt: every "
            "teacher term is 0 up to round-off, which Adam scales into full-size steps of noise. Give the teacher "
            "what the student does not read (teacher_system_prompt, teacher_prompt_template or teacher_prompt_column)."
        )
    if not args.teacher_own_prompt and not has_rewards:
        raise ValueError(
            f"student_as_teacher: {kind} with no teacher context and no reward functions: the teacher starts as the "
            "student reading the same prompt, so every teacher term is 0 and the student never moves from it. Give "
            "the teacher what the student does not read (teacher_system_prompt, teacher_prompt_template or "
            "teacher_prompt_column), or add reward functions (the teacher then holds the student near its start)."
        )
    if kind == "ema" and not peft and args.beta != 0.0:
        raise ValueError(
            f"student_as_teacher: ema with full fine-tuning keeps its moving average in GRPO's reference copy of the "
            f"student, which GRPO's KL penalty (beta={args.beta}) reads as the starting model: the penalty would pull "
            "towards the moving teacher instead. Set beta: 0, or train an adapter (peft_config, use_peft), whose "
            "reference stays the base weights beside the 'ema' adapter."
        )


def check_teacher_loading(teacher_model, args) -> None:
    """`teacher_model_init_kwargs` loads a teacher model from a path: refused where no teacher is loaded so."""
    if not args.teacher_model_init_kwargs:
        return
    source = args.teacher_source(teacher_model)
    loaded = [teacher for teacher in (args.teachers or {}).values() if not is_served(teacher)]
    what = {
        "self": "student_as_teacher's teacher is the student's own weights, in its dtype",
        "reference": "ref_as_teacher's teacher is GRPO's reference copy of the student (model_init_kwargs sets it)",
        "served": "a served teacher is loaded by its server (serve-teacher's options set its dtype)",
        "routed": "every routed teacher is served (each server's options set its dtype)",
    }.get(source)
    if teacher_model is not None and not isinstance(teacher_model, str):
        what = "the teacher was passed as a model, already loaded"
    elif source == "routed" and loaded:
        what = None
    if what:
        raise ValueError(f"teacher_model_init_kwargs loads a teacher model from a path, and {what}: it would be "
                         "ignored. Remove it.")


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
    check_weight_files(model, role="student")
    teachers = args.teachers or {"teacher": teacher_model or args.teacher_model_name_or_path}
    for name, source in teachers.items():
        check_weight_files(source, role=f"teacher {name!r}" if args.teachers else "teacher")
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
