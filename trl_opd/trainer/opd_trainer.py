"""OPDTrainer: GRPO's trainer with the reward replaced (or joined) by a frozen teacher's per-token signal.

The student samples completions (GRPO's generation path, unchanged), the teacher scores exactly those token ids once
per generation batch, and `A[t] = opd_coef * (log pi_T - log pi_old)` goes into GRPO's own `_compute_loss`, which
accepts (B, T) advantages. With reward functions, the two signals combine as `L_RL + opd_loss_coef * L_OPD` on one
student forward, or as summed advantages.
"""

from __future__ import annotations

import os
import warnings
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import is_peft_model
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from torch.distributed.fsdp import FSDPModule
from transformers import AutoTokenizer, PreTrainedModel
from trl import GRPOTrainer
from trl.models import prepare_deepspeed
from trl.models.utils import _ForwardRedirection, disable_gradient_checkpointing
from trl.trainer.utils import get_config_model_id, use_adapter

from ..alignment import ByteVocabulary
from ..checks import check_chat_template, check_head_projectable, check_model_files, check_opd_inputs
from ..config import OPDConfig
from ..heads import OutputHead, head_token_stats
from ..loss import aggregate_as_loss_type
from ..teachers import TeacherScores
from ..teachers.byte_credit import student_prefix_shift
from ..teachers.loading import load_cross_tokenizers, load_teachers
from ..teachers.sources import build_scorer
from . import teacher_inputs
from .advantages import defer_advantages, is_deferred, scores_kept, set_advantages
from .dense import DenseTerm, _ForwardOnly, has_dense_term
from .grpo_calls import LossForward, grpo_attributes
from .hub import HubMixin
from .metrics import CompletionTokenCount, OPDMetrics
from .multiturn import action_mask, action_mask_as_env_mask, check_environments, set_tool_call_parser, skip_first
from .overlap import OverlapScheduler
from .plan import OPDPlan
from .policy import POLICY_TERM_ONLY, metrics_renamed_opd, opd_objective
from .runs import check_finite_logps, check_finite_step, resume_or_claim
from .self_distillation import TeacherEMA, reference_from_student
from .student import completion_logps

# TRL 1.16 and PEFT read `model.is_gradient_checkpointing` at every generation and save, and transformers since the
# rename warns of it: a warning of their code that no option of the run can silence
warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def _name_deepspeed_accelerator() -> None:
    """On a machine without an accelerator, tell DeepSpeed (which accelerate imports where it is installed, whatever
    the run) the CPU it would fall back to, so that it does not warn of a failed GPU detection on every CPU run."""
    if "DS_ACCELERATOR" not in os.environ and not torch.accelerator.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"

# inputs that GRPO's loss forward passes to a vision-language student: those forwards are left to GRPO
_MULTIMODAL_INPUTS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "token_type_ids",
                      "mm_token_type_ids")
_REWARD_METRICS = ("reward", "reward_std", "frac_reward_zero_std")  # GRPO's; meaningless with the teacher alone
# A KL weight that makes GRPO build its reference model, which the reference teacher reads; reset to 0 right after
_BUILD_REFERENCE_BETA = 1e-12


def _is_multimodal(inputs) -> bool:
    return any(key in inputs for key in _MULTIMODAL_INPUTS)


def _teacher_only(**kwargs):
    """Placeholder passed to GRPO's constructor, which demands a reward source; removed right after it returns."""
    raise AssertionError("OPDTrainer removes this placeholder reward function before training.")


class OPDTrainer(HubMixin, GRPOTrainer):
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
        args = args.resolved(teacher_model)  # the defaults for this teacher, on a copy
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

        _name_deepspeed_accelerator()
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

        self.plan = OPDPlan.resolve(args, source=args.teacher_source(teacher_model) or "local",
                                    rewards=bool(self.reward_funcs), grpo=self)
        if self.use_vllm:
            self.vllm_importance_sampling_correction = self.plan.vllm_importance_sampling
            if self.vllm_mode == "colocate" and self.accelerator.device.type == "cpu":
                from .colocate import reload_on_sync

                reload_on_sync(self.vllm_generation)
        self.accuracy_func = accuracy_func
        self.teacher_processing_class = teacher_processing_class
        self.teacher_tokenizers = teacher_tokenizers
        check_head_projectable(self._student_causal_lm())
        if not isinstance(model, str):
            reference_from_student(self.accelerator.unwrap_model(self.model), self.ref_model, zero3=self._zero3())

        # the parts of the step, each an object held here (see docs/development.md, "One training step")
        self.teacher_ema = None  # `student_as_teacher: ema`: the teacher's moving average, saved in each checkpoint
        if args.student_as_teacher == "ema":
            self.teacher_ema = TeacherEMA(self.accelerator.unwrap_model(self.model), self.ref_model,
                                          rate=args.teacher_ema_rate, every=args.teacher_ema_steps,
                                          zero3=self._zero3())
            self.add_callback(self.teacher_ema)
        # the scorer (TeacherScorer: scores exactly the sampled tokens), and the local teacher models, frozen and placed
        self.teacher, self.teacher_models = build_scorer(self, teachers)
        self.teacher_model = self.teacher_models.get("teacher")  # a single local teacher
        self.add_callback(CompletionTokenCount())
        self.opd_metrics = OPDMetrics(self._metrics, self._logs, self.accelerator,
                                      callbacks=lambda: self.callback_handler.callbacks,
                                      log_advantage=not self.plan.advantage_zero)
        self.dense = DenseTerm(self.teacher, beta=args.opd_divergence_beta, metrics=self.opd_metrics,
                               is_student_parameter=self._is_student_parameter)
        self.overlap = None  # `opd_overlap_scoring`: the next batch generated and scored during this one's update
        if self.plan.overlap:
            self.overlap = OverlapScheduler(lambda inputs: self._generate_for_teacher(inputs, old_logps=True),
                                            self._teacher_request, self._logs)
        self._loss_forward: LossForward | None = None  # set by `_compute_loss` for its student forward

    # ------------------------------------------------------------------ set-up

    def _max_over_ranks(self, count: int) -> int:
        """The largest `count` on any process (a collective)."""
        counts = self.accelerator.gather(torch.tensor([count], device=self.accelerator.device))
        return int(counts.max())

    def _prepare_teacher(self, teacher: torch.nn.Module) -> torch.nn.Module:
        """Place the teacher the way GRPO places its reference model: sharded under ZeRO-3 or FSDP2, else on device.
        Under FSDP2 each decoder layer is a unit of its own, as accelerate shards the student (GRPO's `prepare_fsdp`
        makes the whole model one unit, all-gathered whole for each scoring forward)."""
        if self.is_deepspeed_enabled:
            return prepare_deepspeed(teacher, self.accelerator)
        if self.is_fsdp_enabled:
            return fsdp2_prepare_model(self.accelerator, teacher)
        return self.accelerator.prepare_model(teacher, evaluation_mode=True)

    def _zero3(self) -> bool:
        plugin = self.accelerator.state.deepspeed_plugin if self.is_deepspeed_enabled else None
        return plugin is not None and plugin.zero_stage == 3

    def _student_causal_lm(self):
        """The student without its PEFT or distributed wrappers."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        return unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped

    def _student_head(self, student) -> OutputHead:
        """The student's LM head at the sampling temperature: the policy that sampled, as GRPO's log-probs are.
        Under FSDP2 the head is a unit of its own (with the final norm), unsharded by its own forward; the loss reads
        it without that forward, so it is unsharded here, and its gradient reduced with the step's backward."""
        module = student.get_output_embeddings()
        if isinstance(module, FSDPModule):
            module.unshard()  # a no-op while unsharded
        return OutputHead.of(student, temperature=self.temperature)

    def _sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum")

    def _is_student_parameter(self, weight) -> bool:
        return any(parameter is weight for parameter in self.accelerator.unwrap_model(self.model).parameters())

    # ------------------------------------------------------------------ the run: GRPO's, with these parts around it

    def train(self, resume_from_checkpoint=None, **kwargs):
        """GRPO's training, in an output directory of its own or from a complete checkpoint of the same model
        (`resume_from_checkpoint=True`: the newest complete one), with the completion token count and an 'ema'
        teacher restored from it."""
        own = ("completions",) if self.log_completions else ()  # GRPO's constructor made it, for the tables
        resume_from_checkpoint = resume_or_claim(self.args, self.accelerator, self.accelerator.unwrap_model(self.model),
                                                 resume_from_checkpoint, own=own)
        if resume_from_checkpoint is not None:
            self.opd_metrics.token_count.restore(resume_from_checkpoint)
        if self.teacher_ema is not None:
            self.teacher_ema.resume_from(resume_from_checkpoint)
        self.accelerator.print(f"On-policy distillation plan (trl_opd.trainer.plan):\n{self.plan.describe()}")
        with self.overlap.running() if self.overlap is not None else nullcontext():
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if self.overlap is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batches = self.overlap.batch_samples(
            lambda count: super(OPDTrainer, self).get_batch_samples(epoch_iterator, count, device)[0], num_batches)
        return batches, self._get_num_items_in_batch(batches, device)

    def training_step(self, model, inputs, num_items_in_batch):
        self.opd_metrics.start_window()
        with self.dense.heads_held():  # a ZeRO-3 teacher head is gathered once for the step's loss and backward
            return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training:
            self.opd_metrics.add_throughput(logs)
        super().log(logs, start_time)

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        # before this step's logs and checkpoint: every checkpoint saved is one of a finite run
        check_finite_step(tr_loss, grad_norm, accelerator=self.accelerator, step=self.state.global_step)
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """The student, and with the 'ema' kind its teacher's weights beside it (before the trainer state, which a
        checkpoint writes last). Under FSDP2 with sharded checkpoints the Trainer writes no weights here (a
        checkpoint's shards come from its `save_state`): the student's whole weights are gathered and written, so that
        the final model, and each checkpoint's, loads in one process as under ZeRO-3."""
        super().save_model(output_dir, _internal_call)
        if self.is_fsdp_enabled and "FULL_STATE_DICT" not in str(self.accelerator.state.fsdp_plugin.state_dict_type):
            state_dict = self.accelerator.get_state_dict(self.model)  # a collective
            # gathered into tensors of their own, tied weights no longer share storage, by which `save_pretrained`
            # finds them: drop each tied copy by the model's own declaration, as a whole model saves
            for tied in getattr(self.accelerator.unwrap_model(self.model), "all_tied_weights_keys", {}):
                state_dict.pop(tied, None)
            self._save(output_dir, state_dict=state_dict)
        if self.teacher_ema is not None:
            self.teacher_ema.save(Path(output_dir or self.args.output_dir),
                                  is_main_process=self.accelerator.is_main_process)

    # ------------------------------------------------------------------ one generation batch: generate, score, signal

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """1. generate (GRPO's), 2. score (the teacher, once per generation batch), 3. signal: the batch GRPO's loss
        trains on, with the keys OPD adds listed in `batch.OPD_KEYS`."""
        if self.overlap is not None and self.model.training:  # generated and sent to the teacher one step ago
            output, scores, sampled_at = self.overlap.take(inputs, step=self.state.global_step,
                                                           max_steps=self.state.max_steps)
            self.opd_metrics.log("train", "opd/staleness", float(self.state.global_step - sampled_at))
            return self._signal(output, scores, in_loss_forward=False)  # its old log-probs were recorded
        output = self._generate_for_teacher(inputs)
        scores = self._teacher_request(inputs, output)()
        return self._signal(output, scores, in_loss_forward=self.plan.advantages_in_loss_forward)

    def _generate_for_teacher(self, inputs: list[dict[str, Any]], *, old_logps: bool = False) -> dict[str, Any]:
        """GRPO's generation (and rewards, and old log-probs where GRPO computes them) for `inputs`, with the mask of
        the tokens to distil: everything the teacher's scores are then combined with. With `old_logps`, the sampling
        policy's log-probs are recorded too (`_old_policy_pass`)."""
        output = super()._generate_and_score_completions(inputs)
        if not self.plan.rewards:  # GRPO's reward metrics mean nothing with the teacher alone
            for name in ("reward", "reward_std", "frac_reward_zero_std"):
                self._metrics["train" if self.model.training else "eval"].pop(name, None)
        self._set_action_mask(output, action_mask(inputs, output["completion_mask"], output.get("tool_mask")))
        if old_logps:
            self._old_policy_pass(output)
        return output

    def _generate(self, prompts: list):
        self._student_prompts = prompts  # as the student saw them: an environment's reset() observation included
        generated = super()._generate(prompts)
        check_environments(self.environments, self.accelerator)  # none lost its server mid-rollout
        self._student_completions = generated[3]  # as chat messages: the tool loop's turns and tool results
        return generated

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        if self.accuracy_func is not None:
            self._log_accuracy(inputs, prompts, completions, completion_ids_list)
        if self.plan.rewards:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        # GRPO gathers rewards across processes: an empty (global batch, 0) tensor yields zero reward advantages
        return torch.zeros(len(prompts) * self.accelerator.num_processes, 0, device=self.accelerator.device)

    def _log_accuracy(self, inputs, prompts, completions, completion_ids_list) -> None:
        """`accuracy`: the mean of `accuracy_func` (a GRPO reward function: 1 correct, 0 wrong, None to skip) over the
        batch's completions on all processes. A metric only, never trained on; `eval_accuracy` in evaluation. GRPO's
        own reward call computes it, so the function gets every dataset column (and `environments`) as kwargs."""
        with grpo_attributes(self, reward_funcs=[self.accuracy_func], reward_func_names=["accuracy"],
                             reward_processing_classes=[None]):
            correct = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)[:, 0]
        self.opd_metrics.log("train" if self.model.training else "eval", "accuracy", torch.nanmean(correct).item())

    def _teacher_request(self, inputs, output):
        """The teacher's scoring of a generated batch, ready to call, now or from another thread
        (`teacher_inputs.teacher_request`)."""
        return teacher_inputs.teacher_request(self, inputs, output)

    def _signal(self, output: dict[str, Any], scores: TeacherScores, *, in_loss_forward: bool) -> dict[str, Any]:
        """The teacher's advantages (and dense-term inputs, and metrics) for a generated batch, from its scores: now,
        or, `in_loss_forward`, in each micro-batch's loss forward from its own log-probs (see `advantages.py`)."""
        mode = "train" if self.model.training else "eval"
        mask = output["action_mask"]
        if scores.aligned is not None:  # a cross-tokenizer teacher: tokens in no aligned chunk are not distilled
            mask = self._restrict_action_mask(output, scores)
        if self.args.opd_skip_first_tokens:  # after scoring: the teacher still reads those tokens
            mask = self._set_action_mask(output, skip_first(mask, self.args.opd_skip_first_tokens))
        if mode == "train":
            self.opd_metrics.count_completion_tokens(int(output["num_items_in_batch"]))  # all processes' action tokens
        if self.plan.rewards:
            output["reward_advantages"] = output["advantages"]  # (B,), GRPO's; joined with the teacher's
        if self.plan.dense_weight:  # 0: no dense term, or the teacher switched off (opd_loss_coef 0 beside rewards)
            self.dense.keep(output, scores, mode)
        if in_loss_forward:
            if output.get("old_per_token_logps") is not None:
                raise RuntimeError("GRPO computed old log-probs for a batch the plan forms its advantages for in the "
                                   "loss forward: this TRL decides that otherwise than trl_opd.trainer.plan expects.")
            check_finite_logps(scores.logps, None, mask, accelerator=self.accelerator, step=self.state.global_step)
            rows = output["completion_ids"].size(0)
            defer_advantages(output, scores, self.plan, self.opd_metrics.table_row_index(rows))
            self.opd_metrics.expect_deferred_rows(rows)
            return output
        self._old_policy_pass(output)
        if "student_prefix_shift" in output:  # the student's side of the byte credit, under the policy that sampled
            scores = replace(scores, logps=torch.where(mask.bool(), scores.logps - output["student_prefix_shift"],
                                                       scores.logps))
        old_per_token_logps = output["old_per_token_logps"]  # (B, T)
        check_finite_logps(scores.logps, old_per_token_logps, mask, accelerator=self.accelerator,
                           step=self.state.global_step)
        teacher_advantages = set_advantages(output, scores, old_per_token_logps, self.args, self.plan,
                                            sum_over_processes=self._sum_over_processes)
        self.opd_metrics.log_generation_batch(mode, scores, old_per_token_logps, teacher_advantages, mask,
                                              output["completion_mask"], show_advantages=not self.plan.rewards)
        return output

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
            self.opd_metrics.log(mode, "opd/aligned_chunk_tokens_mean", aligned_count / chunks)
        self.opd_metrics.log(mode, "opd/unaligned_token_fraction", 1.0 - aligned_count / max(sampled_count, 1.0))
        output["sampled_mask"] = sampled  # what the student sampled, aligned or not (`trl-opd check` shows it)
        if self.plan.rewards:  # GRPO's reward term trains every sampled token; the teacher's advantage is 0 off `mask`
            output["action_mask"] = mask
            return mask
        return self._set_action_mask(output, mask)

    def _set_action_mask(self, output, mask: torch.Tensor) -> torch.Tensor:
        """`mask` as the tokens to distil (GRPO's `tool_mask` too), with the batch's token count from it."""
        output["action_mask"] = output["tool_mask"] = mask
        output["num_items_in_batch"] = self.accelerator.gather(mask.sum()).sum()
        return mask

    # ------------------------------------------------------------------ the sampling policy's and reference log-probs

    def _old_policy_pass(self, output) -> None:
        """What the advantage needs from the policy that sampled the batch, from one no-grad forward of it:
        `old_per_token_logps` where GRPO did not already compute them (on-policy, no vLLM), and, with a
        cross-tokenizer teacher's byte credit, the student's side of that credit, `student_prefix_shift` (see
        `byte_credit`; then a forward of its own where GRPO computed the old log-probs)."""
        byte_credit = self.plan.byte_credit
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

    # ------------------------------------------------------------------ one micro-batch: the loss

    _forward_redirection = _ForwardRedirection()

    def _compute_loss(self, model, inputs):
        """4. loss: GRPO's objective on the batch's advantages (formed in this forward, where the plan says) and the
        dense term, on one student forward; its log-probs projected at the completion only where GRPO's head would
        project every position (`student.py`)."""
        compact = self.plan.compact_logps and not _is_multimodal(inputs)
        self._loss_forward = LossForward(
            compact=self._completion_logps if compact else None,
            observe=partial(self._form_advantages, inputs) if is_deferred(inputs) else None,
            reuse=self.plan.combination == "loss",
        )
        try:
            if not has_dense_term(inputs) and not compact:
                return self._policy_loss(model, inputs)
            # The whole loss runs inside the student's forward (TRL's forward redirection, as its distillation trainer
            # does): DDP then prepares its backward once, and under ZeRO-3 the LM head, which the dense term and the
            # compact log-probs read directly, is gathered on access and stays registered to the model for the
            # backward, where ZeRO reduces its gradient. Inside, the student is called through its `forward`: its
            # hooks already ran for this call.
            unwrapped = self.accelerator.unwrap_model(model)
            return self._forward_redirection(model, unwrapped, self._loss_inside_forward, _ForwardOnly(unwrapped),
                                             inputs)
        finally:
            self._loss_forward = None

    def _completion_logps(self, model, *args, **kwargs):
        """The student's log-probs at the completion positions only (`student.completion_logps`), its head read at the
        call: inside the loss's forward, where ZeRO-3 has gathered it."""
        student = self._student_causal_lm()
        return completion_logps(student, self._student_head(student), self.accelerator.autocast, model, *args,
                                **kwargs)

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        """GRPO's, run as the loss's instruction says within `_compute_loss` (`grpo_calls.LossForward`)."""
        grpo_call = super()._get_per_token_logps_and_entropies
        if self._loss_forward is None:
            return grpo_call(model, *args, **kwargs)
        return self._loss_forward.run(grpo_call, model, *args, **kwargs)

    def _loss_inside_forward(self, model, inputs):
        student = self._student_causal_lm()
        if self.plan.policy_term_zero and is_deferred(inputs) and not _is_multimodal(inputs):
            # the dense term is the whole loss: the backbone alone, no vocabulary projection but the dense term's
            input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            with self.accelerator.autocast():
                hidden = student.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            hidden = hidden.last_hidden_state
            self._lean_forward_signal(inputs, hidden, student)
            return self._dense_loss(inputs, hidden, student)
        if not has_dense_term(inputs):
            return self._policy_loss(model, inputs)  # no dense term: GRPO's loss, its log-probs compact
        hidden = []
        hook = student.base_model.register_forward_hook(lambda m, a, out: hidden.append(out.last_hidden_state))
        try:
            loss = self._policy_loss(model, inputs)
        finally:
            hook.remove()
        return loss + self._dense_loss(inputs, hidden[0], student)

    def _form_advantages(self, inputs, old_per_token_logps) -> None:
        """A deferred micro-batch's advantages from the loss forward's detached log-probs, and its `opd/*` metrics."""
        scores = scores_kept(inputs)
        check_finite_logps(scores.logps, old_per_token_logps, inputs["action_mask"], accelerator=self.accelerator,
                           step=self.state.global_step)
        teacher_advantages = set_advantages(inputs, scores, old_per_token_logps, self.args, self.plan,
                                            sum_over_processes=self._sum_over_processes)
        self.opd_metrics.log_deferred("train" if self.model.training else "eval", inputs, scores, old_per_token_logps,
                                      teacher_advantages, show_advantages=not self.plan.rewards)

    def _lean_forward_signal(self, inputs, student_hidden, student) -> None:
        """Where GRPO's loss forward does not run (a dense term alone): the (zero) advantages and the deferred `opd/*`
        metrics from the sampled tokens' log-probs, which on-policy are the old ones, and the student's `entropy`,
        over the distilled tokens, from one no-grad projection of those positions."""
        completion_ids, mask = inputs["completion_ids"], inputs["action_mask"]
        valid = mask.bool()  # only these positions are projected onto the vocabulary
        hidden = student_hidden[:, -completion_ids.size(1) - 1 : -1].detach()
        valid_logps, valid_entropy, _ = head_token_stats(hidden[valid], self._student_head(student),
                                                         completion_ids[valid])
        self._form_advantages(inputs, valid_logps.new_zeros(mask.shape).masked_scatter(valid, valid_logps))
        self.opd_metrics.log_entropy("train" if self.model.training else "eval", valid_entropy.sum(), mask.sum())

    def _policy_loss(self, model, inputs) -> torch.Tensor:
        """GRPO's loss on the batch's advantages: the teacher's, summed with the rewards', or both objectives."""
        if self.plan.combination != "loss":  # teacher only (the OPD objective), or rewards' advantages summed
            with grpo_attributes(self, **(opd_objective(self.args) if not self.plan.rewards else {})):
                return super()._compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        rl_loss = super()._compute_loss(model, inputs)
        if self.args.opd_loss_coef == 0.0:
            return rl_loss
        with grpo_attributes(self, **POLICY_TERM_ONLY, **opd_objective(self.args)), \
                metrics_renamed_opd(self._metrics[mode]):
            opd_loss = super()._compute_loss(model, {**inputs, "advantages": inputs["teacher_advantages"]})
        # GRPO's loss is divided for gradient accumulation; the metrics are on the scale of the logged `loss`
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        for name, value in (("rl/loss", rl_loss), ("opd/loss", opd_loss)):
            self.opd_metrics.log(mode, name, self.accelerator.gather(value.detach()).mean().item() * accumulation)
        return rl_loss + self.args.opd_loss_coef * opd_loss

    def _dense_loss(self, inputs, student_hidden, student) -> torch.Tensor:
        """The dense term (`DenseTerm.per_token`), weighted, and aggregated as GRPO's `loss_type` aggregates its
        policy term (and for gradient accumulation alike), so that the two add on one scale."""
        mode = "train" if self.model.training else "eval"
        per_token = self.dense.per_token(inputs, student_hidden, self._student_head(student), mode)
        training = mode == "train"
        return self.plan.dense_weight * aggregate_as_loss_type(
            per_token, inputs["action_mask"], loss_type=self.loss_type,
            accumulation=self.current_gradient_accumulation_steps if training else 1.0,
            max_completion_length=self.max_completion_length,
            num_items_in_batch=inputs.get("num_items_in_batch"), num_processes=self.accelerator.num_processes,
            micro_steps_per_generation=self.args.steps_per_generation if training else 1.0,
        )
