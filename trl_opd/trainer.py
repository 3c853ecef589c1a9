"""OPDTrainer: GRPO's trainer with the reward replaced (or joined) by a frozen teacher's per-token signal.

The student samples completions (GRPO's generation path, unchanged), the teacher scores exactly those token ids once
per generation batch, and `A[t] = opd_coef * (log pi_T - log pi_old)` goes into GRPO's own `_compute_loss`, which
accepts (B, T) advantages. With reward functions, the two signals combine as `L_RL + opd_loss_coef * L_OPD` on one
student forward, or as summed advantages.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedModel
from trl import GRPOTrainer
from trl.models import prepare_deepspeed, prepare_fsdp
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import get_config_model_id, use_adapter

from .advantages import AdvantagesMixin
from .alignment import ByteVocabulary
from .checks import check_chat_template, check_head_projectable, check_model_files, check_opd_inputs
from .config import OPDConfig
from .dense import DenseLossMixin
from .hub import HubMixin
from .loss import shared_temperature
from .metrics import OPDMetricsMixin
from .multiturn import action_mask, action_mask_as_env_mask, check_environments, set_tool_call_parser, skip_first
from .overlap import OverlapScoringMixin
from .policy import PolicyObjectiveMixin
from .runs import RunSafetyMixin
from .self_distillation import SelfDistillationMixin
from .student import StudentMixin
from .teacher_inputs import TeacherInputsMixin
from .teachers import LocalTeacher, TeacherScorer, TeacherScores
from .teachers.byte_credit import student_prefix_shift
from .teachers.cross import CrossTokenizerTeacher
from .teachers.loading import load_cross_tokenizers, load_teachers
from .teachers.local import freeze_teacher
from .teachers.reference import ReferenceTeacher
from .teachers.routed import RoutedTeacher

_REWARD_METRICS = ("reward", "reward_std", "frac_reward_zero_std")  # GRPO's; meaningless with the teacher alone
# A KL weight that makes GRPO build its reference model, which the reference teacher reads; reset to 0 right after
_BUILD_REFERENCE_BETA = 1e-12


def _teacher_only(**kwargs):
    """Placeholder passed to GRPO's constructor, which demands a reward source; removed right after it returns."""
    raise AssertionError("OPDTrainer removes this placeholder reward function before training.")


class OPDTrainer(RunSafetyMixin, HubMixin, TeacherInputsMixin, OverlapScoringMixin, OPDMetricsMixin,
                 AdvantagesMixin, PolicyObjectiveMixin, StudentMixin, DenseLossMixin, SelfDistillationMixin,
                 GRPOTrainer):
    """On-policy distillation trainer. See `OPDConfig` for the OPD settings and docs/metrics.md for the metrics.

    Args:
        model: the student, as a path/Hub id or a model (optionally wrapped by `peft_config`).
        teacher_model: the frozen teacher, as a path/Hub id or a model. Defaults to `args.teacher_model_name_or_path`;
            leave it unset for the other sources: `teacher_server_url`, `ref_as_teacher`, `student_as_teacher`.
        args: an `OPDConfig`.
        train_dataset / eval_dataset: prompt-only datasets with a `prompt` column (text or chat messages).
        processing_class: the student's tokenizer; loaded from the student's path when omitted.
        reward_funcs: optional GRPO reward functions, mixed with the teacher signal (see `opd_reward_combination`).
        reward_processing_classes / quantization_config: GRPO's, passed on: each reward model's tokenizer (None: its
            own), and the `BitsAndBytesConfig` of a student loaded from a path (and of GRPO's reference copy).
        peft_config: a PEFT config to train an adapter instead of the full student.
        accuracy_func: a GRPO-style reward function scoring each completion 1 (correct) or 0, logged as `accuracy`
            (and `eval_accuracy` in evaluation) and never trained on.
        tools / environment_factory / rollout_func: GRPO's multi-turn paths. Only the tokens the student sampled are
            distilled: GRPO's tool mask, or an `action_mask` a rollout function returns per row (GRPO's `env_mask`
            too; see `_action_mask`). An environment's `get_reward` joins the reward functions. A teacher with another
            tokenizer reads the observations through its own template (see `_completion_messages`).
        teacher_processing_class: the teacher's tokenizer, for the compatibility check; loaded from the teacher's
            path when omitted (and taken to be the student's for a teacher model with no path). In cross mode, the
            tokenizer the teacher reads the text with (every routed teacher's, if routed).
    """

    _tag_names = ["trl", "opd", "on-policy-distillation"]
    _name = "OPD"

    def __init__(
        self,
        model: str | PreTrainedModel,
        teacher_model: str | PreTrainedModel | None = None,
        args: OPDConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_funcs=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        teacher_processing_class=None,
        tools=None,
        environment_factory=None,
        rollout_func=None,
        accuracy_func=None,
    ):
        student_name = model if isinstance(model, str) else get_config_model_id(model.config)
        if args is None:
            args = OPDConfig(output_dir=f"{student_name.split('/')[-1]}-OPD")
        if not isinstance(args, OPDConfig):
            raise TypeError(f"OPDTrainer needs an OPDConfig, got {type(args).__name__}.")
        reward_funcs = list(reward_funcs) if isinstance(reward_funcs, list) else [reward_funcs] if reward_funcs else []
        args.resolve_estimator(teacher_model)
        # an environment class's `get_reward` becomes a reward function in GRPO, with what that asks of the batch
        factories = environment_factory.values() if isinstance(environment_factory, dict) else [environment_factory]
        env_rewards = [factory.get_reward for factory in factories if hasattr(factory, "get_reward")]
        check_opd_inputs(model, teacher_model, args, train_dataset, eval_dataset, reward_funcs, peft_config,
                         env_rewards=env_rewards, reward_processing_classes=reward_processing_classes)
        check_model_files(model, teacher_model, args)
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(
                student_name, padding_side="left", truncation_side="left", trust_remote_code=args.trust_remote_code
            )
        check_chat_template(processing_class, train_dataset, name="train_dataset")
        student_tokenizer = getattr(processing_class, "tokenizer", processing_class)
        set_tool_call_parser(student_tokenizer, args, multi_turn=bool(tools or environment_factory))
        teacher_tokenizers = None  # cross mode: each teacher's own tokenizer, by name
        if args.teacher_tokenizer_mode == "cross":
            teacher_tokenizers = load_cross_tokenizers(teacher_model, args, student_tokenizer=student_tokenizer,
                                                       teacher_tokenizer=teacher_processing_class)
            for tokenizer in teacher_tokenizers.values():
                check_chat_template(tokenizer, train_dataset, name="train_dataset", role="teacher")
            teacher_processing_class = teacher_tokenizers.get("teacher")
        teachers = load_teachers(
            model, teacher_model, args, student_name=student_name, student_tokenizer=student_tokenizer,
            teacher_tokenizer=teacher_tokenizers if teacher_tokenizers is not None else teacher_processing_class,
        )

        user_beta = args.beta
        if (args.ref_as_teacher or args.student_as_teacher in ("initial", "ema")) and user_beta == 0.0:
            args.beta = _BUILD_REFERENCE_BETA  # GRPO builds (or, for PEFT, designates) its reference only for beta > 0
        try:
            super().__init__(  # every argument of GRPO's (tests/test_trainer.py checks that none is left out)
                model=model, reward_funcs=reward_funcs or [_teacher_only], args=args, train_dataset=train_dataset,
                eval_dataset=eval_dataset, processing_class=processing_class,
                reward_processing_classes=reward_processing_classes, callbacks=callbacks, optimizers=optimizers,
                quantization_config=quantization_config, peft_config=peft_config, tools=tools,
                environment_factory=environment_factory, rollout_func=action_mask_as_env_mask(rollout_func),
            )
        finally:
            args.beta = user_beta
        self.beta = user_beta  # no KL penalty unless asked for; the reference teacher computes its own log-probs
        if not reward_funcs:  # drop the placeholder; an environment's `get_reward`, if any, stays
            keep = [i for i, func in enumerate(self.reward_funcs) if func is not _teacher_only]
            self.reward_funcs = [self.reward_funcs[i] for i in keep]
            self.reward_func_names = [self.reward_func_names[i] for i in keep]
            self.reward_processing_classes = [self.reward_processing_classes[i] for i in keep]
            self.reward_weights = self.reward_weights[keep]

        if self.use_vllm and self.vllm_mode == "colocate" and self.accelerator.device.type == "cpu":
            from .colocate import sync_by_reload

            self.vllm_generation.sync_weights = partial(sync_by_reload, self.vllm_generation)
        if self.use_vllm and self.vllm_importance_sampling_correction and self._policy_term_always_zero():
            # vLLM's importance-sampling correction reweights GRPO's policy term, which a dense term alone makes 0: its
            # extra forward for the old log-probs would buy nothing (the sampler's gap is logged from the loss forward)
            self.vllm_importance_sampling_correction = False
        self.accuracy_func = accuracy_func
        self.teacher_processing_class = teacher_processing_class
        self.teacher_tokenizers = teacher_tokenizers
        check_head_projectable(self._student_causal_lm())
        if not isinstance(model, str):
            self._reference_from_student()
        self._prepare_self_teacher()
        self.teacher = self._build_scorer(teachers)
        self._init_opd_metrics()

    # ------------------------------------------------------------------ set-up

    def _build_scorer(self, teachers: dict) -> TeacherScorer | RoutedTeacher:
        """The scorer the trainer calls. Local teachers are frozen and placed here, once the accelerator exists;
        `self.teacher_models` keeps them by name (a single teacher is "teacher", also `self.teacher_model`)."""
        args = self.args
        self.teacher_models = {
            name: self._prepare_teacher(freeze_teacher(teacher))
            for name, teacher in teachers.items() if isinstance(teacher, torch.nn.Module)
        }
        self.teacher_model = self.teacher_models.get("teacher")
        if args.ref_as_teacher:
            return ReferenceTeacher(self._reference_logps)
        student_vocab_size = self._student_causal_lm().config.get_text_config().vocab_size
        scoring = dict(batch_size=args.teacher_batch_size or args.per_device_train_batch_size,
                       autocast=self.accelerator.autocast, return_hidden=args.opd_estimator == "full",
                       topk=args.opd_topk if args.opd_estimator == "topk" else 0, student_vocab_size=student_vocab_size)
        if args.student_as_teacher:  # at the student's sampling temperature, so that it starts equal to its teacher
            scorers = {"teacher": self._self_teacher(temperature=self.temperature, **scoring)}
        else:
            scorers = {name: LocalTeacher(self.teacher_models[name], temperature=args.teacher_temperature, **scoring)
                       if name in self.teacher_models else teacher for name, teacher in teachers.items()}
        if args.opd_estimator == "topk" and args.opd_topk > student_vocab_size:
            raise ValueError(f"opd_topk={args.opd_topk} exceeds the student's vocabulary of {student_vocab_size} "
                             "tokens: the top-k term compares at most that many. Lower opd_topk.")
        for scorer in scorers.values() if args.opd_estimator == "full" else ():  # a pair the kernel cannot apply
            shared_temperature(self._student_head(self._student_causal_lm()), scorer.output_head)
        if args.teacher_tokenizer_mode == "cross":  # each teacher reads the sampled text its own way
            scorers = {
                name: CrossTokenizerTeacher(
                    scorer, student_tokenizer=self._tokenizer, teacher_tokenizer=self.teacher_tokenizers[name],
                    stop_ids=self.eos_token_ids, tools=self.tools, chat_template_kwargs=self.chat_template_kwargs,
                    credit=args.teacher_cross_credit or "byte",
                ) for name, scorer in scorers.items()
            }
        if not args.teachers:
            return scorers["teacher"]
        sharded = tuple(self.teacher_models) if self.is_deepspeed_enabled else ()  # ZeRO-3 forwards are collectives
        return RoutedTeacher(scorers, collective=sharded, max_over_ranks=self._max_over_ranks)

    def _policy_term_always_zero(self) -> bool:
        """A dense term alone: no sampled-token term, no rewards, no KL or entropy term, batches used once, so
        GRPO's policy loss is 0 on every batch (see `DenseLossMixin._policy_loss_is_zero`, the same per batch)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return (self.args.opd_coef == 0.0 and self.args.opd_dense_coef is not None and not self.reward_funcs
                and self._no_other_grpo_loss_term() and self.args.gradient_accumulation_steps % generate_every == 0)

    def _max_over_ranks(self, count: int) -> int:
        """The largest `count` on any process (a collective)."""
        counts = self.accelerator.gather(torch.tensor([count], device=self.accelerator.device))
        return int(counts.max())

    def _prepare_teacher(self, teacher: torch.nn.Module) -> torch.nn.Module:
        """Place the teacher the way GRPO places its reference model: sharded under ZeRO-3/FSDP, else on device."""
        if self.is_deepspeed_enabled:
            return prepare_deepspeed(teacher, self.accelerator)
        if self.is_fsdp_enabled:
            return prepare_fsdp(teacher, self.accelerator)
        return self.accelerator.prepare_model(teacher, evaluation_mode=True)

    def _reference_logps(self, input_ids, attention_mask, logits_to_keep) -> torch.Tensor:
        """Log-probs of the student's starting point: GRPO's reference model, or the student with its adapter off."""
        model, adapter, size = self.model, None, self.args.teacher_batch_size  # the teacher's sequences per forward
        if self.ref_model is not None:
            model = self.ref_model
        elif "ref" in self.accelerator.unwrap_model(self.model).peft_config:
            adapter = "ref"  # a student that came with a trained adapter: GRPO keeps a frozen copy as "ref"
        if model is self.model:
            with use_adapter(self.accelerator.unwrap_model(self.model), adapter_name=adapter):
                return self._no_grad_logps(model, input_ids, attention_mask, logits_to_keep, size)
        return self._no_grad_logps(model, input_ids, attention_mask, logits_to_keep, size)

    def _no_grad_logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None) -> torch.Tensor:
        """Per-token log-probs of the last `logits_to_keep` tokens under `model`, without gradient, (B, T)."""
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep,
                batch_size=batch_size or self.args.per_device_train_batch_size,
            )
        return logps

    # ------------------------------------------------------------------ scoring

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        if self.accuracy_func is not None:
            self._log_accuracy(inputs, prompts, completions, completion_ids_list)
        if self.reward_funcs:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        # GRPO gathers rewards across processes: an empty (global batch, 0) tensor yields zero reward advantages
        return torch.zeros(len(prompts) * self.accelerator.num_processes, 0, device=self.accelerator.device)

    def _generate(self, prompts: list):
        self._student_prompts = prompts  # as the student saw them: an environment's reset() observation included
        generated = super()._generate(prompts)
        check_environments(self.environments, self.accelerator)  # none lost its server mid-rollout
        self._student_completions = generated[3]  # as chat messages: the tool loop's turns and tool results
        return generated

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        if self._overlapping():  # the batch was generated and sent to the teacher one step ago (`overlap`)
            return self._overlapped_batch(inputs)
        output = self._generate_for_teacher(inputs)
        return self._finish_with_scores(output, self._teacher_request(inputs, output)())

    def _generate_for_teacher(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """GRPO's generation (and rewards, and old log-probs where GRPO computes them) for `inputs`, with the mask of
        the tokens to distil: everything the teacher's scores are then combined with."""
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        if not self.reward_funcs:
            for name in _REWARD_METRICS:
                self._metrics[mode].pop(name, None)
        self._action_mask(inputs, output)  # (B, T)
        return output

    def _finish_with_scores(self, output: dict[str, Any], scores: TeacherScores) -> dict[str, Any]:
        """The teacher's advantages (and dense-term inputs, and metrics) for a generated batch, from its scores."""
        mode = "train" if self.model.training else "eval"
        completion_mask = output["completion_mask"]
        mask = output["action_mask"]
        if scores.aligned is not None:  # a cross-tokenizer teacher: tokens in no aligned chunk are not distilled
            mask = self._restrict_action_mask(output, scores)
        if self.args.opd_skip_first_tokens:  # after scoring: the teacher still reads those tokens
            mask = self._set_action_mask(output, skip_first(mask, self.args.opd_skip_first_tokens))
        if mode == "train":
            self._count_completion_tokens(int(output["num_items_in_batch"]))  # all processes' action tokens
        if self.reward_funcs:
            output["reward_advantages"] = output["advantages"]  # (B,), GRPO's; joined with the teacher's
        if self._advantages_in_loss_forward(output):
            # On-policy, the old log-probs are the loss forward's own, detached: the advantage is formed there, in
            # the one student forward (`_use_loss_forward_logps`), and the metrics that need them are logged there
            self._check_finite(scores.logps, None, mask)
            self._defer_advantages(output, scores)
            self._keep_dense_inputs(output, scores)
            return output
        self._old_policy_pass(output)
        if "student_prefix_shift" in output:  # the student's side of the byte credit, under the policy that sampled
            scores = replace(scores, logps=torch.where(mask.bool(), scores.logps - output["student_prefix_shift"],
                                                       scores.logps))
        old_per_token_logps = output["old_per_token_logps"]  # (B, T)
        self._check_finite(scores.logps, old_per_token_logps, mask)
        teacher_advantages = self._set_advantages(output, scores, old_per_token_logps)
        self._keep_dense_inputs(output, scores)
        self._log_opd_metrics(mode, scores, old_per_token_logps, teacher_advantages, mask, completion_mask)
        return output

    def _action_mask(self, inputs, output) -> torch.Tensor:
        """The tokens to distil, (B, T) (see `action_mask`). GRPO's loss reads `tool_mask`, so that is set to the same
        mask, and the batch's token count is recomputed from it."""
        return self._set_action_mask(output, action_mask(inputs, output["completion_mask"], output.get("tool_mask")))

    def _restrict_action_mask(self, output, scores: TeacherScores) -> torch.Tensor:
        """Drop from the action mask the sampled tokens a cross-tokenizer teacher could not align (its tokenizer
        rewrote the text, or has no token for a byte), and log how coarse the alignment is:
        `opd/aligned_chunk_tokens_mean` student tokens per chunk, `opd/unaligned_token_fraction` of the sampled tokens
        left out."""
        sampled = output["action_mask"]
        mask = sampled * scores.aligned.to(sampled.dtype)
        counts = torch.stack([sampled.sum(), mask.sum(), (scores.text_chunk_ends & mask.bool()).sum()]).float()
        sampled_count, aligned_count, chunks = self.accelerator.reduce(counts, reduction="sum").tolist()
        mode = "train" if self.model.training else "eval"
        if chunks:
            self._metrics[mode]["opd/aligned_chunk_tokens_mean"].append(aligned_count / chunks)
        self._metrics[mode]["opd/unaligned_token_fraction"].append(1.0 - aligned_count / max(sampled_count, 1.0))
        output["sampled_mask"] = sampled  # what the student sampled, aligned or not (`trl-opd check` shows it)
        if self.reward_funcs:  # GRPO's reward term trains every sampled token; the teacher's advantage is 0 off `mask`
            output["action_mask"] = mask
            return mask
        return self._set_action_mask(output, mask)

    def _set_action_mask(self, output, mask: torch.Tensor) -> torch.Tensor:
        """`mask` as the tokens to distil (GRPO's `tool_mask` too), with the batch's token count from it."""
        output["action_mask"] = output["tool_mask"] = mask
        output["num_items_in_batch"] = self.accelerator.gather(mask.sum()).sum()
        return mask

    def _old_policy_pass(self, output) -> None:
        """What the advantage needs from the policy that sampled the batch, from one no-grad forward of it:
        `old_per_token_logps` where GRPO did not already compute them (on-policy, no vLLM), and, with a
        cross-tokenizer teacher's byte credit, the student's side of that credit, `student_prefix_shift` (see
        `byte_credit`; then a forward of its own where GRPO computed the old log-probs)."""
        byte_credit = self.args.byte_credit
        done = output.get("old_per_token_logps") is not None
        if done and (not byte_credit or "student_prefix_shift" in output):
            return
        batch = output["prompt_ids"], output["prompt_mask"], output["completion_ids"], output["completion_mask"]
        if not byte_credit:
            output["old_per_token_logps"] = self._student_logps(*batch)
            return
        logps, hidden = self._student_logps(*batch, hidden=True)
        output["student_prefix_shift"] = student_prefix_shift(
            ByteVocabulary.of(self._tokenizer), output["completion_ids"], output["completion_mask"],
            output["action_mask"], self.eos_token_ids, logps, hidden, self._student_head(self._student_causal_lm()),
        )
        if not done:
            output["old_per_token_logps"] = logps

    def _student_logps(self, prompt_ids, prompt_mask, completion_ids, completion_mask, *, hidden: bool = False):
        """log pi_old of the sampled tokens (B, T), by a no-grad forward of the student; with `hidden`, also its final
        hidden states before each completion token (B, T, H)."""
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        width = completion_ids.size(1)
        if not hidden:
            return self._no_grad_logps(self.model, input_ids, attention_mask, width)
        states = []  # one per forward batch
        hook = self._student_causal_lm().base_model.register_forward_hook(
            lambda module, args, out: states.append(out.last_hidden_state[:, -width - 1 : -1].detach()))
        try:
            logps = self._no_grad_logps(self.model, input_ids, attention_mask, width)
        finally:
            hook.remove()
        return logps, torch.cat(states)

    # ------------------------------------------------------------------ loss

    def _compute_loss(self, model, inputs):
        # the student's log-probs projected at the completion (where GRPO's head would project every position), and
        # observed for the advantage (on-policy); the dense terms and GRPO's objective on that one forward
        with self._compact_student_logps(inputs), self._observe_loss_forward_logps(inputs):
            return self._dense_and_policy_loss(model, inputs)
