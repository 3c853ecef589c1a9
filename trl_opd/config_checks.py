"""Which options are valid together: the one module that says so, before anything loads.

`check_options` runs at the end of `OPDConfig.__post_init__`; `resolve_estimator` and `check_run_options` when the
trainer is built, before any weights load, once it knows what it was given (a teacher model rather than one named in
the config, reward functions, an adapter). What a teacher source can do is read from its declaration
(`teachers/sources.py`), never from its name. Each refusal says what is wrong and what to set instead.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from typing import TYPE_CHECKING

from .prompts import template_columns
from .secrets import has_credentials, masked
from .teachers.cross import CROSS_CREDITS
from .teachers.sources import SOURCES, source_support
from .teachers.vllm_server import check_server_address, is_served

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .config import OPDConfig

OPD_OBJECTIVES = ("clipped", "importance_sampling")
REWARD_COMBINATIONS = ("loss", "advantage")
OPD_ESTIMATORS = ("sampled", "topk", "full")
TOKENIZER_MODES = ("same", "cross")
SELF_TEACHER_KINDS = ("initial", "live", "ema")  # student_as_teacher: which of the student's weights teach
# GRPO loss types whose objective is min(r A, clip(r) A); the unclipped objective is defined against these
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def check_options(args: OPDConfig) -> None:
    """Every OPD option's value alone and against the others (GRPO's own are checked by GRPOConfig)."""
    _check_choices(args)
    _check_numbers(args)
    _check_grpo_options(args)
    _check_teacher_options(args)
    support = source_support(args)  # what the teacher source declares it can do (`teachers/sources.py`)
    _check_estimator_source(args.opd_estimator, support)
    _check_tokenizer_mode(args, support)
    _check_overlap(args, support)


def _check_grpo_options(args: OPDConfig) -> None:
    """GRPO's options that this package cannot honour, or this machine cannot run, refused by name."""
    import torch

    if (args.fp16 or args.fp16_full_eval) and (args.use_cpu or not torch.accelerator.is_available()):
        raise ValueError("fp16 mixed precision needs a GPU, and this machine has none. Set `fp16: false` in the "
                         "recipe, `--fp16 false` on the command line, or OPDConfig(fp16=False).")
    if args.use_liger_kernel:
        raise ValueError(
            "use_liger_kernel is not supported: Liger's kernels are GPU (Triton) kernels that this package has not "
            "run with OPD's loss forward and teacher scoring (and TRL 1.16 deprecates the option). Remove it."
        )


def _check_choices(args: OPDConfig) -> None:
    """The options that name one of a few choices."""
    choices = {"opd_objective": OPD_OBJECTIVES, "opd_reward_combination": REWARD_COMBINATIONS,
               "teacher_tokenizer_mode": TOKENIZER_MODES}
    optional = {"opd_estimator": OPD_ESTIMATORS, "teacher_cross_credit": CROSS_CREDITS,  # None: a default
                "student_as_teacher": SELF_TEACHER_KINDS}
    for name, allowed in (*choices.items(), *optional.items()):
        value = getattr(args, name)
        if value not in allowed and not (name in optional and value is None):
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}.")
    if args.opd_objective == "importance_sampling" and args.loss_type not in CLIPPED_LOSS_TYPES:
        raise ValueError(
            f"opd_objective='importance_sampling' removes the clipping of a clipped objective, but loss_type="
            f"{args.loss_type!r} has none. Use one of {CLIPPED_LOSS_TYPES}, or opd_objective='clipped'."
        )


def _check_numbers(args: OPDConfig) -> None:
    """The numeric options' ranges."""
    if not 0.0 <= args.opd_divergence_beta <= 1.0:
        raise ValueError(f"opd_divergence_beta must be in [0, 1] (0 forward KL, 1 reverse KL), got "
                         f"{args.opd_divergence_beta}.")
    for name in ("opd_coef", "opd_dense_coef", "opd_loss_coef", "kl_discount_factor", "teacher_temperature"):
        value = getattr(args, name)
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}.")
    if args.max_completion_length is not None and args.max_completion_length < 1:
        raise ValueError(f"max_completion_length must be at least 1 token, got {args.max_completion_length}.")
    if args.max_steps == 0 or (args.max_steps < 0 and args.num_train_epochs <= 0):
        raise ValueError(
            f"Nothing to train: max_steps={args.max_steps}, num_train_epochs={args.num_train_epochs}. Set "
            "max_steps > 0, or num_train_epochs > 0 with max_steps unset (-1)."
        )
    if not args.teacher_server_timeout > 0:
        raise ValueError(f"teacher_server_timeout must be positive (seconds), got {args.teacher_server_timeout}.")
    if not args.teacher_server_startup_timeout >= 0:
        raise ValueError("teacher_server_startup_timeout must be 0 or more (seconds), got "
                         f"{args.teacher_server_startup_timeout}.")
    if args.teacher_server_max_retries < 0:
        raise ValueError(f"teacher_server_max_retries must be 0 or more, got {args.teacher_server_max_retries}.")
    if not 0.0 <= args.kl_discount_factor < 1.0:
        raise ValueError(f"kl_discount_factor must be in [0, 1), got {args.kl_discount_factor}.")
    if args.opd_topk is not None and args.opd_topk < 1:
        raise ValueError(f"opd_topk must be at least 1, got {args.opd_topk}.")
    if args.teacher_temperature <= 0:
        raise ValueError(f"teacher_temperature must be positive, got {args.teacher_temperature}.")
    if args.teacher_batch_size is not None and args.teacher_batch_size < 1:
        raise ValueError(f"teacher_batch_size must be a positive integer, got {args.teacher_batch_size}.")
    if args.opd_skip_first_tokens < 0:
        raise ValueError(f"opd_skip_first_tokens must be 0 or more tokens, got {args.opd_skip_first_tokens}.")
    if args.teacher_ema_rate is not None and not 0.0 < args.teacher_ema_rate <= 1.0:
        raise ValueError(f"teacher_ema_rate must be in (0, 1] (1: a hard copy of the student), got "
                         f"{args.teacher_ema_rate}.")
    if args.teacher_ema_steps is not None and args.teacher_ema_steps < 1:
        raise ValueError(f"teacher_ema_steps must be a positive number of optimizer steps, got "
                         f"{args.teacher_ema_steps}.")


def _check_teacher_options(args: OPDConfig) -> None:
    """One teacher source, each address well formed (a credential in one warned about), and what goes with it."""
    if args.teachers is not None and not isinstance(args.teachers, dict):
        raise ValueError(
            f"teachers must be a mapping of teacher names to a model path/Hub id or server URL(s), e.g. "
            f"{{\"math\": \"Qwen/Qwen3-8B\"}}; got {type(args.teachers).__name__} "
            f"{masked(str(args.teachers))[:100]!r}."
        )
    named = {"teacher_model_name_or_path": [args.teacher_model_name_or_path],
             "teacher_server_url": args.teacher_server_url or []}
    for name, teacher in (args.teachers or {}).items():
        named[f"teachers[{name!r}]"] = teacher if isinstance(teacher, list) else [teacher]
    for option, values in named.items():
        for value in values:
            check_server_address(option, value)
    if any(has_credentials(url) for values in named.values() for url in values):
        warnings.warn(
            "A teacher server URL carries credentials (user:password@host). trl_opd masks them in everything it "
            "writes or prints, but a URL is not the place for a secret: put an API key in an environment "
            "variable and name it in teacher_server_api_key_env.", stacklevel=3,
        )
    chosen = [option for support in SOURCES.values() for option in support.chooses if getattr(args, option)]
    if sorted(chosen) == ["teacher_model_name_or_path", "teacher_server_url"]:
        chosen = ["teacher_server_url"]  # the served teacher's checkpoint, for its head (`teachers.served_hidden`)
    if len(chosen) > 1:
        raise ValueError(f"Choose one teacher source, not {' and '.join(chosen)}.")
    if args.teacher_adapter_name_or_path and chosen and chosen != ["teacher_model_name_or_path"]:
        raise ValueError(
            "teacher_adapter_name_or_path goes onto a local teacher model (teacher_model_name_or_path), "
            f"not {chosen[0]}."
        )
    if args.teacher_prompt_column and (args.teacher_system_prompt or args.teacher_prompt_template):
        other = "teacher_system_prompt" if args.teacher_system_prompt else "teacher_prompt_template"
        raise ValueError(f"Set {other} or teacher_prompt_column, not both: the column is the teacher's whole prompt.")
    if args.teacher_prompt_template is not None:
        template_columns(args.teacher_prompt_template)
    _check_self_teacher(args)


def _updates_per_generation(args: OPDConfig) -> float:
    """Optimizer steps taken on one generation batch."""
    steps = args.steps_per_generation or args.gradient_accumulation_steps
    return steps * args.num_iterations / args.gradient_accumulation_steps


def _moving_head(args: OPDConfig) -> bool:
    """The teacher's head moves with the student within one generation batch (a live or 'ema' self-teacher, more than
    one optimizer step per batch)."""
    return args.student_as_teacher in ("live", "ema") and _updates_per_generation(args) > 1


def _check_self_teacher(args: OPDConfig) -> None:
    """What goes with `student_as_teacher`, and what it excludes."""
    kind = args.student_as_teacher
    for name in ("teacher_ema_rate", "teacher_ema_steps"):
        if getattr(args, name) is not None and kind != "ema":
            raise ValueError(f"{name} sets how the teacher follows the student with student_as_teacher: ema, and "
                             f"this run has student_as_teacher: {kind}. Remove it, or set student_as_teacher: ema.")
    if args.opd_estimator == "full" and _moving_head(args):
        raise ValueError(
            f"opd_estimator='full' projects the teacher's hidden states, kept from scoring, through its head at the "
            f"loss; with student_as_teacher: {kind} that head moves with the student, and this run takes "
            f"{_updates_per_generation(args):g} optimizer steps per generation batch, so later steps would read a "
            "teacher that never existed. Take one step per generation batch (steps_per_generation unset, "
            "num_iterations 1), or use opd_estimator 'topk' or 'sampled'."
        )
    if kind and args.sync_ref_model:
        raise ValueError(
            f"sync_ref_model moves GRPO's reference model towards the student, which student_as_teacher: {kind} "
            "may read as the teacher. Remove sync_ref_model; for a teacher that follows the student, set "
            "student_as_teacher: ema (teacher_ema_rate, teacher_ema_steps)."
        )


def resolve_estimator(args: OPDConfig, served=None) -> None:
    """`opd_estimator`, `opd_coef`, `opd_dense_coef` and `opd_topk` filled in for the teacher source, and an estimator
    that source cannot provide refused. `served` is what the trainer was given as its teacher, if anything: a served
    teacher's default depends on what its servers give (asked of them), its URLs or the configured ones."""
    support = source_support(args, served)
    _check_tokenizer_mode(args, support)
    _check_overlap(args, support)
    if args.opd_estimator is None and args.teacher_tokenizer_mode == "cross":
        args.opd_estimator = "sampled"
    if args.opd_estimator is None and support is not None:
        args.opd_estimator = support.default_estimator
        if args.opd_estimator == "full" and _moving_head(args):
            args.opd_estimator = "topk"  # 'full' would read the moving head at the loss (see _check_self_teacher)
        elif args.opd_estimator == "servers":
            from .teachers.served_hidden import serves_hidden_states

            # the served teachers' servers decide (routed: a local teacher gives everything)
            urls = ([served if is_served(served) else None] if not args.teachers else
                    [teacher for teacher in args.teachers.values() if is_served(teacher)])
            args.opd_estimator = "full" if all(serves_hidden_states(args, url) for url in urls) else "topk"
            logger.warning("opd_estimator: %r, the best the teacher %s (%s).", args.opd_estimator,
                           "servers and models give" if args.teachers else "server gives",
                           "hidden states, projected by each teacher's head here" if args.opd_estimator == "full" else
                           "log-probs, no hidden states: `trl-opd serve-teacher MODEL --hidden-states` gives 'full'")
    args.opd_estimator = args.opd_estimator or "sampled"
    _check_estimator_source(args.opd_estimator, support)
    _check_self_teacher(args)
    if args.opd_coef is None:
        args.opd_coef = 1.0 if args.opd_estimator == "sampled" else 0.0
    if args.opd_estimator == "sampled" and args.opd_dense_coef is not None:
        raise ValueError(
            f"opd_dense_coef={args.opd_dense_coef} weighs the dense term of 'topk' and 'full', and "
            "opd_estimator='sampled' has none. Scale the sampled term with opd_coef, or choose a dense estimator."
        )
    if args.opd_estimator != "topk" and args.opd_topk is not None:
        raise ValueError(
            f"opd_topk={args.opd_topk} is the k of opd_estimator='topk', and this run uses "
            f"{args.opd_estimator!r}. Remove it, or set opd_estimator: topk."
        )
    if args.opd_estimator != "sampled" and args.opd_dense_coef is None:
        args.opd_dense_coef = 1.0
    if args.opd_estimator == "topk" and args.opd_topk is None:
        args.opd_topk = 20


def _check_estimator_source(estimator: str | None, support) -> None:
    """An estimator the teacher source declares it can provide (`SourceSupport.estimators`)."""
    if estimator is None or support is None or estimator in support.estimators:
        return
    named = support.option
    if estimator == "full":
        raise ValueError(
            f"opd_estimator='full' needs the teacher's hidden states, which a local teacher model or a server "
            f"started with `trl-opd serve-teacher MODEL --hidden-states` provides (alone or routed), not {named}. "
            "Use opd_estimator='sampled'."
        )
    raise ValueError(
        f"opd_estimator='topk' needs teacher models, local or served (alone or routed), not {named}. Use "
        "opd_estimator='sampled'."
    )


def _check_tokenizer_mode(args: OPDConfig, support) -> None:
    """What a cross-tokenizer teacher can and cannot do, refused before anything loads."""
    if args.teacher_tokenizer_mode != "cross":
        if args.teacher_cross_credit is not None:
            raise ValueError(
                f"teacher_cross_credit={args.teacher_cross_credit!r} shares a cross-tokenizer teacher's log-probs "
                "among the student's tokens; a same-tokenizer teacher scores every token itself. Remove it, or set "
                "teacher_tokenizer_mode: cross."
            )
        if args.teacher_tokenizer_name_or_path is not None:
            raise ValueError(
                "teacher_tokenizer_name_or_path is the tokenizer of a teacher from another model family, used with "
                "teacher_tokenizer_mode: cross. A same-tokenizer teacher scores the student's ids with the student's "
                "tokenizer: remove it, or set teacher_tokenizer_mode: cross."
            )
        return
    if support is not None and not support.own_tokenizer:
        raise ValueError(
            f"teacher_tokenizer_mode 'cross' is for a teacher with its own tokenizer; {support.option} is the "
            "student's own model. Remove teacher_tokenizer_mode."
        )
    tokenizers = args.teacher_tokenizer_name_or_path
    if isinstance(tokenizers, dict):
        if not args.teachers:
            raise ValueError(
                "teacher_tokenizer_name_or_path is a mapping of routed teacher names to tokenizers, but there are no "
                "routed `teachers`: give the one teacher's tokenizer as a path or Hub id."
            )
        unknown = sorted(set(tokenizers) - set(args.teachers))
        if unknown:
            raise ValueError(f"teacher_tokenizer_name_or_path names {unknown[0]!r}, which is not among the routed "
                             f"teachers {sorted(args.teachers)}.")
    if args.teachers and not isinstance(tokenizers, str):
        for name, teacher in args.teachers.items():
            if is_served(teacher) and name not in (tokenizers or {}):
                raise ValueError(
                    f"teachers[{name!r}] is served, and a served teacher's tokenizer cannot be read from the server: "
                    "name it in teacher_tokenizer_name_or_path, e.g. "
                    f"{{{name!r}: <the served model's path or Hub id>}}."
                )
    if args.opd_estimator not in (None, "sampled"):
        raise ValueError(
            f"opd_estimator={args.opd_estimator!r} compares the two models over one vocabulary at every position, "
            "and a teacher with another tokenizer has another vocabulary. Use opd_estimator='sampled' (the default "
            "with teacher_tokenizer_mode 'cross'), which scores the sampled text exactly."
        )


def _check_overlap(args: OPDConfig, support) -> None:
    """What `opd_overlap_scoring` needs, refused before anything loads: a teacher off the trainer's devices
    (`SourceSupport.off_trainer`), and at most one update between sampling a batch and training on it."""
    if not args.opd_overlap_scoring:
        return
    if support is not None and not support.off_trainer:
        raise ValueError(
            f"opd_overlap_scoring overlaps a served teacher's scoring with the student's update, and {support.option} "
            "runs on the trainer's own devices, between the same steps: there is nothing to overlap. Serve the teacher "
            "(`trl-opd serve-teacher MODEL`, then teacher_server_url), or remove opd_overlap_scoring."
        )
    if args.num_iterations != 1:
        raise ValueError(
            f"opd_overlap_scoring trains each batch one update after the policy that sampled it; num_iterations="
            f"{args.num_iterations} would train it again later, more updates stale. Set num_iterations: 1, or "
            "remove opd_overlap_scoring."
        )
    if args.steps_per_generation not in (None, args.gradient_accumulation_steps):
        raise ValueError(
            f"opd_overlap_scoring needs one optimizer step per generation batch, and steps_per_generation="
            f"{args.steps_per_generation} with gradient_accumulation_steps={args.gradient_accumulation_steps} makes "
            f"{args.steps_per_generation / args.gradient_accumulation_steps:g}, so a batch's last micro-batches would "
            "be more than one update stale. Leave steps_per_generation unset (or equal to "
            "gradient_accumulation_steps), or remove opd_overlap_scoring."
        )


# ------------------------------------------------------------------ at the trainer, with what it was given


def check_run_options(args: OPDConfig, *, teacher_model, rewards: bool, peft: bool) -> None:
    """The options against what the trainer was given, before any weights load: `teacher_model` (a teacher passed to
    the trainer, or None), whether reward functions join the teacher, whether the student trains an adapter."""
    options = [option for support in SOURCES.values() for option in support.chooses]
    if teacher_model is not None and any(getattr(args, option) for option in options
                                         if option not in SOURCES["local"].chooses):  # the model given replaces it
        raise ValueError("Pass a teacher model or set another teacher source in the OPDConfig, not both.")
    if args.teacher_source(teacher_model) is None:
        raise ValueError(
            "OPDTrainer needs a teacher: pass `teacher_model=` (a path or a model), or set one of "
            f"{', '.join(f'`{option}`' for option in options)}."
        )
    support = source_support(args, teacher_model)
    if not support.teacher_temperature and args.teacher_temperature != 1.0:
        raise ValueError(
            f"teacher_temperature does not apply to {support.option}: the student as its own teacher scores at its "
            "sampling `temperature`, so that it starts equal to its teacher."
        )
    if args.ref_as_teacher and args.sync_ref_model:
        raise ValueError(
            "sync_ref_model moves GRPO's reference model towards the student, and ref_as_teacher reads that "
            "reference as the teacher: the teacher would drift to the student. Remove sync_ref_model; for a "
            "teacher that follows the student, use student_as_teacher: ema."
        )
    if not args.teachers and args.teacher_route_column != "teacher":
        raise ValueError(f"teacher_route_column={args.teacher_route_column!r} routes rows among `teachers`, and "
                         "none are set. Remove it, or set teachers.")
    check_options_apply(args, has_rewards=rewards)
    check_teacher_loading(teacher_model, args)
    if args.student_as_teacher:
        check_self_teacher(args, has_rewards=rewards, peft=peft)
    check_fsdp(args)
    if rewards and args.num_generations < 2:
        raise ValueError(
            "Reward functions need groups of completions per prompt (GRPO normalises rewards within a group): "
            f"set num_generations >= 2 (got {args.num_generations})."
        )


def check_fsdp(args) -> None:
    """FSDP2 (`fully_shard`) is this package's second sharding engine beside ZeRO-3; what it does not run is refused
    by name. The FSDP settings come from the TrainingArguments (`fsdp`, `fsdp_config`) or from an accelerate launch
    (its FSDP_* environment)."""
    # an accelerate launch on GPUs says FSDP in its environment (the state it builds later), on CPU in the state
    launched = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if not (args.fsdp or launched or args.distributed_state.distributed_type == "FSDP"):
        return
    if args.fsdp_plugin_args is not None:  # the TrainingArguments' own FSDP settings
        version, offload = args.fsdp_plugin_args["fsdp_version"], args.fsdp_plugin_args.get("cpu_offload", False)
    elif args.fsdp:
        version, offload = int(args.fsdp_config.get("version", 2)), bool(args.fsdp_config.get("cpu_offload"))
    else:  # accelerate launch: its plugin's defaults
        version = int(os.environ.get("FSDP_VERSION", "1"))
        offload = os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true"
    if version != 2:
        raise ValueError(
            f"FSDP version {version} is not supported: OPDTrainer shards with FSDP2 (`fully_shard`), whose DTensor "
            "parameters its teacher heads and checkpoints read. Set fsdp_version: 2 in the accelerate config "
            "(recipes/accelerate/fsdp2.yaml), or use ZeRO-3 (recipes/accelerate/zero3.yaml)."
        )
    state = args.distributed_state
    if state.device.type == "cpu" and state.distributed_type not in ("FSDP", "NO"):
        # accelerate engages FSDP only on GPU-like devices: on CPU processes these settings would train plain data
        # parallel (`trl-opd` sets the FSDP state there for an accelerate launch with an FSDP config)
        raise ValueError(
            f"fsdp is set, but these {state.distributed_type} processes would not shard: on CPU "
            "processes FSDP2 comes from an accelerate launch, accelerate launch --config_file "
            "recipes/accelerate/fsdp2_cpu.yaml -m trl_opd ..."
        )
    if offload:
        raise ValueError(
            "FSDP2 with CPU offload of the parameters is not supported: the teacher's heads and the student's "
            "gathered weights are built and tested with parameters on the device. Set fsdp_offload_params: false, or "
            "offload with ZeRO-3 (offload_param_device: cpu)."
        )


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
    if args.opd_constant_advantage and (args.opd_estimator != "sampled" or has_rewards):
        raise ValueError(
            "opd_constant_advantage replaces the teacher's sampled-token advantage by a constant, as a control: "
            + (f"opd_estimator={args.opd_estimator!r} carries the teacher's signal in its dense term, which the "
               "control would leave in place. Use opd_estimator='sampled'." if args.opd_estimator != "sampled" else
               "with reward functions, the run would still learn from their per-completion signal. Train on the "
               "teacher alone (no reward_funcs).")
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
    support = source_support(args, teacher_model)
    what = support.not_loaded if support is not None else None
    if teacher_model is not None and not isinstance(teacher_model, str):
        what = "the teacher was passed as a model, already loaded"
    if what:
        raise ValueError(f"teacher_model_init_kwargs loads a teacher model from a path, and {what}: it would be "
                         "ignored. Remove it.")
