"""OPDConfig: GRPOConfig plus the on-policy distillation fields, nothing else."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments
from trl import GRPOConfig

from .config_checks import (
    CROSS_CREDITS,
    OPD_ESTIMATORS,
    OPD_OBJECTIVES,
    REWARD_COMBINATIONS,
    TOKENIZER_MODES,
    check_options,
    resolve_estimator,
)
from .secrets import masked
from .teachers.vllm_server import is_served

# transformers 5 renamed `gradient_checkpointing` to `activation_checkpointing`; vLLM's CPU build pins one from before.
# OPDConfig takes the new name under either; other configs take `{ACTIVATION_CHECKPOINTING: ...}`.
_BEFORE_THE_RENAME = "activation_checkpointing" not in TrainingArguments.__dataclass_fields__
ACTIVATION_CHECKPOINTING = "gradient_checkpointing" if _BEFORE_THE_RENAME else "activation_checkpointing"


class _UngroupedOne(int):
    """The integer 1 that passes GRPO's `num_generations >= 2` check and nothing else.

    GRPO normalises rewards within a group of completions per prompt and so rejects groups of one. OPD's advantage is
    per token and needs no group. Every other check GRPO makes with `num_generations` (divisibility of the generation
    and eval batches) is exactly right for 1, so only the comparison changes, for the duration of `__post_init__`.
    """

    def __lt__(self, other):
        return False


@dataclass
class OPDConfig(GRPOConfig):
    r"""
    Configuration for [`OPDTrainer`]: every [`~trl.GRPOConfig`] field, plus the on-policy distillation ones below.

    The advantage of sampled completion token `a_t` is `opd_coef * (log pi_T(a_t|s_t) - log pi_old(a_t|s_t))`,
    optionally replaced by its discounted future sum (`kl_discount_factor`), and goes into GRPO's policy objective.
    Unlike GRPO, `num_generations=1` is allowed: the teacher signal needs no group of completions per prompt.
    """

    _VALID_DICT_FIELDS = GRPOConfig._VALID_DICT_FIELDS + ["teacher_model_init_kwargs", "teachers",
                                                          "teacher_tokenizer_name_or_path"]

    # TRL's default (checkpointing on) is set under transformers' current name in `__post_init__`, so that no run
    # warns of a deprecated option it never set; `gradient_checkpointing`, when set, is honoured (and warned of)
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Deprecated alias of `activation_checkpointing` (transformers 5); unset, checkpointing is "
                          "on, as in TRL."},
    )
    dataloader_pin_memory: bool | None = field(
        default=None,
        metadata={"help": "Pin the prompt batches' memory. Unset: on where torch sees an accelerator (a GPU), off "
                          "elsewhere, where there is nothing to pin for (transformers warns of that on every run)."},
    )
    if _BEFORE_THE_RENAME:  # so recipes read the same under an older transformers
        activation_checkpointing: bool | None = field(
            default=None,
            metadata={"help": "Checkpoint activations in the backward pass (on by default, as in TRL)."},
        )
    teacher_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Path or Hub id of the frozen teacher. Used when the trainer is not given a `teacher_model`. The "
            "teacher must share the student's tokenizer (checked at start-up), unless teacher_tokenizer_mode is "
            "'cross'. Beside teacher_server_url, the served teacher's checkpoint, of which only the head is read."
        },
    )
    teacher_tokenizer_mode: str = field(
        default="same",
        metadata={
            "help": "'same': the teacher scores the student's token ids, so both must share one tokenizer (checked at "
            "start-up). 'cross': the teacher has its own tokenizer and chat template (another model family): it "
            "reads the prompt through its own template and scores the text the student sampled, tokenised its way "
            "(see teacher_cross_credit for how its log-probs reach the student's tokens). The sampled estimator "
            "only; a local, served or adapter teacher, or routed teachers (each with its own tokenizer).",
            "choices": list(TOKENIZER_MODES),
        },
    )
    teacher_tokenizer_name_or_path: dict[str, str] | str | None = field(
        default=None,
        metadata={
            "help": "With teacher_tokenizer_mode 'cross': the teacher's tokenizer and chat template. Defaults to the "
            "local teacher's own; required for a served teacher (the server's tokenisation is checked against it). "
            "With routed `teachers`, one tokenizer for all of them, or a mapping of teacher names to tokenizers, "
            'e.g. {"code": "Qwen/Qwen2.5-Coder-7B-Instruct"} (a local teacher left out reads its own)."'
        },
    )
    teacher_cross_credit: str | None = field(
        default=None,
        metadata={
            "help": "With teacher_tokenizer_mode 'cross', how the teacher's log-prob of the sampled text is shared "
            "among the student's tokens. 'byte' (the default): each student token gets both models' log-ratio of "
            "its bytes given the text before them (each model's probability that the text goes on so, read from its "
            "whole next-token distribution where a token may go on; a served teacher's top 20 entries: a lower "
            "bound), so each token is credited for its own choice only and an identical teacher gives every token "
            "0. 'chunk': the text is cut where both tokenisations have a boundary "
            "and every student token of a chunk gets the chunk's log-prob difference, which also credits a token "
            "with the choices after it inside the chunk (e.g. where a number ends); measured to drift where the "
            "teacher writes numbers in multi-digit tokens.",
            "choices": [None, *CROSS_CREDITS],
        },
    )
    teacher_model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments for `AutoModelForCausalLM.from_pretrained` when the teacher is loaded from a "
            "path, e.g. `{\"dtype\": \"float32\"}`. Without a dtype here, the teacher loads in the student's "
            "(model_init_kwargs' dtype, or the student model's own)."
        },
    )
    opd_coef: float | None = field(
        default=None,
        metadata={
            "help": "Scale of the sampled-token teacher advantage, `A = opd_coef * (teacher_logp - student_old_logp)`: "
            "the beta or KL penalty coefficient of the on-policy distillation references. Default: 1 with the "
            "'sampled' estimator, 0 with 'topk' and 'full' (their dense term alone measured best; set it > 0 to add "
            "the sampled term and its sequence-level credit)."
        },
    )
    opd_objective: str = field(
        default="clipped",
        metadata={
            "help": "Policy objective the teacher advantage feeds. 'clipped': GRPO's clipped surrogate "
            "`max(-A r, -A clip(r, 1 - epsilon, 1 + epsilon_high))` for the configured `loss_type`. "
            "'importance_sampling': the unclipped `-A r`. Both aggregate tokens as `loss_type` does.",
            "choices": list(OPD_OBJECTIVES),
        },
    )
    opd_estimator: str | None = field(
        default=None,
        metadata={
            "help": "How the teacher's signal reaches the student. 'sampled': the per-token advantage of the "
            "sampled token in the policy objective. 'topk': a dense loss term (weight opd_dense_coef) at every "
            "completion position, the reverse KL over the teacher's opd_topk most likely tokens and one bucket for "
            "the rest (local, served or routed teachers). 'full': the dense term is the exact reverse KL over the "
            "whole vocabulary (local teachers, or served ones that return hidden states; routed too). Dense terms are "
            "computed in tiles; with opd_coef > 0 the sampled term is added to them. Default: the best one the "
            "teacher source supports, as measured (docs/estimators.md): 'full' for local teachers, served ones with "
            "hidden states (`serve-teacher --hidden-states`) and the student as its own (student_as_teacher; 'topk' "
            "where its weights move between scoring and the loss), 'topk' where a server gives log-probs only, "
            "'sampled' otherwise.",
            "choices": list(OPD_ESTIMATORS),
        },
    )
    opd_divergence_beta: float = field(
        default=1.0,
        metadata={
            "help": "Which divergence the dense term of 'topk' and 'full' is, with TRL's meaning of beta: 1 the "
            "reverse KL(student || teacher), 0 the forward KL(teacher || student), in between the generalised "
            "Jensen-Shannon divergence with mixture beta * teacher + (1 - beta) * student. The sampled-token term is "
            "always the reverse KL (the student's own samples estimate it without importance weights), so a beta "
            "other than 1 needs a dense term."
        },
    )
    opd_dense_coef: float | None = field(
        default=None,
        metadata={
            "help": "Weight of the dense term of opd_estimator 'topk' or 'full' (default 1.0 there). The 'sampled' "
            "estimator has no dense term, so setting it there is an error."
        },
    )
    opd_topk: int | None = field(
        default=None,
        metadata={
            "help": "k of opd_estimator='topk' (default 20): how many of the teacher's most likely tokens per "
            "position the dense term compares one by one. A served teacher must allow it (vLLM --max-logprobs; "
            "serve-teacher sets 20). Setting it with another estimator is an error."
        },
    )
    kl_discount_factor: float = field(
        default=0.0,
        metadata={
            "help": "Discount gamma in [0, 1). If > 0, each token's advantage becomes the discounted sum of the "
            "advantages from that token to the end of its completion. 0 (default) keeps the per-token advantage."
        },
    )
    opd_constant_advantage: bool = field(
        default=False,
        metadata={
            "help": "A control run (does the teacher's signal matter?): every distilled token's advantage becomes "
            "the constant -mean|A|, the mean magnitude of the teacher's advantages `A` over the generation batch's "
            "distilled tokens on all processes, in place of `A` itself. The teacher still scores every batch, so the "
            "magnitude and the logged KL are those of the run it controls, and so is the step's cost, except where "
            "a generation batch spans several micro-batches (steps_per_generation > 1): the control then forms its "
            "advantages at generation, with one more no-grad forward of the student. Only the per-token information "
            "is gone, leaving a push down on every token the student sampled. Needs opd_estimator 'sampled' (the "
            "dense estimators carry the signal outside the advantage) and no reward functions."
        },
    )
    teacher_server_url: list[str] | None = field(
        default=None,
        metadata={
            "help": "Base URL(s) of vLLM servers serving the teacher (`trl-opd serve-teacher MODEL` starts one), "
            "e.g. http://10.0.0.5:8000. Used instead of a local teacher model; each generation batch is spread "
            "across the URLs."
        },
    )
    teacher_server_api_key_env: str | None = field(
        default="OPD_TEACHER_API_KEY",
        metadata={"help": "Environment variable holding the teacher servers' API key (vLLM's --api-key), if any."},
    )
    teacher_server_timeout: float = field(
        default=300.0,
        metadata={"help": "Seconds to wait for one teacher server answer before retrying."},
    )
    teacher_server_max_retries: int = field(
        default=3,
        metadata={"help": "Retries of a teacher request after a connection error, timeout or 5xx answer."},
    )
    teacher_server_startup_timeout: float = field(
        default=240.0,
        metadata={"help": "Seconds to wait at start-up for a teacher server that is not up yet (refuses connections "
                          "or answers 503 while it loads its model) before stopping with an error."},
    )
    teacher_adapter_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A PEFT adapter loaded onto the teacher model and merged before scoring (e.g. a domain expert "
            "trained on the student's base). Must have been trained on the teacher model."
        },
    )
    ref_as_teacher: bool = field(
        default=False,
        metadata={
            "help": "Use GRPO's reference model (the frozen initial student) as the teacher: no second model is "
            "loaded and opd/reverse_kl is 0 at the first step. A sanity check of the whole data path."
        },
    )
    student_as_teacher: str | None = field(
        default=None,
        metadata={
            "help": "Self-distillation: the student is its own teacher, reading the teacher's context "
            "(teacher_system_prompt, teacher_prompt_template or teacher_prompt_column) that the student does not "
            "see. 'initial': its starting weights (a PEFT student's adapter as it started, off for a new one; with "
            "full fine-tuning a frozen copy, GRPO's reference model); 'live': its current weights, without gradient "
            "and without a second copy; "
            "'ema': a moving average of its weights (teacher_ema_rate, teacher_ema_steps), kept in float32. Every "
            "estimator works with each. A teacher with no context of its own is refused ('initial' and 'ema' are "
            "allowed beside reward functions, as a pull towards the start).",
            "choices": [None, "initial", "live", "ema"],
        },
    )
    teacher_ema_rate: float | None = field(
        default=None,
        metadata={
            "help": "With student_as_teacher 'ema': each update moves the teacher this far towards the student, "
            "teacher <- (1 - rate) * teacher + rate * student (1.0: a hard copy). Default 0.05."
        },
    )
    teacher_ema_steps: int | None = field(
        default=None,
        metadata={"help": "With student_as_teacher 'ema': the optimizer steps between updates. Default 1."},
    )
    teacher_is_student_base: bool = field(
        default=False,
        metadata={"help": "Deprecated: `student_as_teacher: initial`, which it now sets."},
    )
    teachers: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Several teachers by name, each a local path/Hub id or a server URL (or a list of URLs), e.g. "
            "{\"math\": \"Qwen/Qwen3-8B\", \"code\": \"http://10.0.0.7:8000\"}. Each row is scored by the "
            "teacher its `teacher_route_column` names."
        },
    )
    teacher_route_column: str = field(
        default="teacher",
        metadata={"help": "With `teachers`: the dataset column naming the teacher that scores each row."},
    )
    teacher_temperature: float = field(
        default=1.0,
        metadata={
            "help": "Temperature the teacher's logits are divided by before its log-probs are taken, in every "
            "estimator; the student's side is always divided by its sampling `temperature`. Local teachers only."
        },
    )
    teacher_system_prompt: str | None = field(
        default=None,
        metadata={
            "help": "A system message only the teacher sees, before the student's chat prompt (privileged "
            "information / context distillation). Both score the identical completion tokens."
        },
    )
    teacher_prompt_column: str | None = field(
        default=None,
        metadata={
            "help": "A dataset column holding the prompt the teacher sees instead of the student's, in the same "
            "format (text or chat messages)."
        },
    )
    teacher_prompt_template: str | None = field(
        default=None,
        metadata={
            "help": "The teacher's user message as a template over the row, e.g. \"{prompt}\\n\\nThe expected output "
            "is: {solution}\": `{prompt}` is the student's last user message (its text), any other `{name}` the row's "
            "column. The rest of the prompt (system message, earlier turns) is the student's; the teacher's chat "
            "template renders the whole."
        },
    )
    opd_skip_first_tokens: int = field(
        default=0,
        metadata={
            "help": "Leave the first n completion tokens out of the teacher's terms (and their metrics): e.g. where a "
            "teacher with privileged context opens its answer differently for reasons the student cannot see."
        },
    )
    opd_loss_coef: float = field(
        default=1.0,
        metadata={
            "help": "With reward functions: lambda in `L = L_RL + lambda * L_OPD` (opd_reward_combination='loss'), "
            "or in `A = A_reward + lambda * A_teacher` (opd_reward_combination='advantage'). It scales the whole "
            "teacher signal, dense term included: 0 trains on rewards only, exactly as GRPO."
        },
    )
    opd_reward_combination: str = field(
        default="loss",
        metadata={
            "help": "How rewards and the teacher combine. 'loss': two clipped objectives on one student forward, "
            "summed. 'advantage': the advantages are summed before one clipped objective. They differ because the "
            "clipped objective is not linear in the advantage.",
            "choices": list(REWARD_COMBINATIONS),
        },
    )
    teacher_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Sequences per teacher forward (or per request to a teacher server) when scoring a generation "
            "batch. Defaults to `per_device_train_batch_size`."
        },
    )
    opd_overlap_scoring: bool = field(
        default=False,
        metadata={
            "help": "Score the next generation batch with a served teacher while the student updates on this one, so "
            "the teacher's time overlaps the update. Each batch is then trained one update after the policy that "
            "sampled it, with that policy's log-probs as pi_old (GRPO's clipped ratio corrects for it; "
            "`opd/staleness` logs it). Needs served teachers only, one optimizer step per generation batch "
            "(steps_per_generation = gradient_accumulation_steps) and num_iterations 1."
        },
    )
    untagged_tool_calls: bool = field(
        default=False,
        metadata={"help": "With tools or an environment: also run a turn that is only a JSON tool call, bare or in a "
                  "code fence ({\"name\": ..., \"arguments\": {...}}), without its template's tags (e.g. "
                  "<tool_call>), as small models often write it. Off: such a turn is an answer, as in GRPO."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start a new run in an output_dir that already holds files, deleting its checkpoints first (so "
            "that a later resume cannot pick up the old run's). Without it, a non-empty output_dir is refused "
            "unless the run resumes from a checkpoint."
        },
    )

    def teacher_source(self, teacher_model=None) -> str | None:
        """Where the teacher's scores come from, whichever way it was named: 'local', 'served', 'reference',
        'self' (student_as_teacher) or 'routed'; None while no source is known. `teacher_model` is what the trainer
        was given."""
        if self.ref_as_teacher:
            return "reference"
        if self.student_as_teacher:
            return "self"
        if self.teachers:
            return "routed"
        named = self.teacher_model_name_or_path if teacher_model is None else teacher_model
        if self.teacher_server_url or is_served(named):
            return "served"
        if teacher_model is not None or self.teacher_model_name_or_path:
            return "local"
        return None

    @property
    def teacher_own_prompt(self) -> bool:
        """The teacher reads a prompt of its own (a system message, a template or a column), not the student's."""
        return bool(self.teacher_system_prompt or self.teacher_prompt_template or self.teacher_prompt_column)

    @property
    def byte_credit(self) -> bool:
        """A cross-tokenizer teacher credited by bytes (the default credit there), whose advantage also needs the
        sampling policy's own prefix probabilities (`teachers.byte_credit`)."""
        return self.teacher_tokenizer_mode == "cross" and (self.teacher_cross_credit or "byte") == "byte"

    def resolved(self, teacher_model=None) -> OPDConfig:
        """A copy with the defaults of `opd_estimator`, `opd_coef`, `opd_dense_coef` and `opd_topk` (see their help)
        filled in for the teacher source, an estimator that source cannot provide refused. `teacher_model` is what the
        trainer was given, if anything; a served teacher's default is asked of its servers. This config stays as given,
        so one config can serve trainers with different teachers; the trainer holds the copy as `trainer.args`."""
        copy = object.__new__(type(self))  # not copy.copy: pickling's state drops the Hub token and URL credentials
        copy.__dict__.update(self.__dict__)
        resolve_estimator(copy, served=teacher_model)
        return copy

    def __getstate__(self) -> dict:
        """What pickling keeps, e.g. `training_args.bin` in the output directory and every checkpoint: no Hub token,
        and server URLs without credentials. The live object keeps both for the run."""
        state = {name: masked(value) for name, value in self.__dict__.items()}
        state["hub_token"] = None
        return state

    def to_dict(self) -> dict:
        """As TrainingArguments' (tokens replaced by placeholders), with server URLs' credentials masked: this is what
        logs and trackers record."""
        return masked(super().to_dict())

    def __post_init__(self):
        if self.dataloader_pin_memory is None:
            import torch

            self.dataloader_pin_memory = torch.accelerator.is_available()
        if _BEFORE_THE_RENAME:  # an older transformers reads only the old name
            if self.gradient_checkpointing is None:
                self.gradient_checkpointing = self.activation_checkpointing is not False  # TRL's default: on
            self.activation_checkpointing = self.gradient_checkpointing
        elif self.activation_checkpointing is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = True  # TRL's default
        if self.num_generations == 1:
            self.num_generations = _UngroupedOne(1)
        try:
            super().__post_init__()
        except ValueError as error:
            if "doesn't support bf16" in str(error):  # transformers' advice (use_cpu) is not the fix here
                raise ValueError(
                    "bf16 is on (as set, or GRPOConfig's default when unset), and this machine has no GPU with "
                    "bfloat16 (Ampere or later). Set `bf16: false` in the recipe, `--bf16 false` on the command "
                    "line, or OPDConfig(bf16=False)."
                ) from None
            raise
        finally:
            if isinstance(self.num_generations, _UngroupedOne):
                self.num_generations = 1
        if self.teacher_model_name_or_path == "":
            self.teacher_model_name_or_path = None  # `--teacher_model_name_or_path ""` unsets a recipe's teacher
        if isinstance(self.teacher_server_url, str):
            self.teacher_server_url = [self.teacher_server_url]
        if self.teacher_is_student_base:
            warnings.warn("teacher_is_student_base is deprecated: it is `student_as_teacher: initial`, now set.",
                          FutureWarning, stacklevel=3)
            self.teacher_is_student_base, self.student_as_teacher = False, self.student_as_teacher or "initial"
        check_options(self)
        if self.student_as_teacher == "ema":
            self.teacher_ema_rate = 0.05 if self.teacher_ema_rate is None else self.teacher_ema_rate
            self.teacher_ema_steps = 1 if self.teacher_ema_steps is None else self.teacher_ema_steps
