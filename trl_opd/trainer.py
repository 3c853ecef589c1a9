"""OPDTrainer: GRPO's trainer with the reward replaced by a frozen teacher's per-token signal.

The student samples completions (GRPO's generation path, unchanged), the teacher scores exactly those token ids once
per generation batch, and `A[t] = opd_coef * (log pi_T - log pi_old)` goes into GRPO's own `_compute_loss`, which
accepts (B, T) advantages.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel
from trl import GRPOTrainer
from trl.models import prepare_deepspeed, prepare_fsdp
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import create_model_from_path, get_config_model_id

from .checks import check_prompt_dataset, check_tokenizers_compatible, check_vocab_sizes
from .config import OPDConfig
from .loss import opd_advantages, opd_metric_sums, opd_metrics_from_sums
from .teachers import LocalTeacher, TeacherScorer
from .teachers.local import freeze_teacher
from .teachers.vllm_server import VLLMServerTeacher

# Metrics GRPO derives from rewards; meaningless (all NaN or 0) when the teacher is the only signal
_REWARD_METRICS = ("reward", "reward_std", "frac_reward_zero_std")


def _teacher_only(**kwargs):
    """Placeholder passed to GRPO's constructor, which demands a reward source; removed right after it returns."""
    raise AssertionError("OPDTrainer removes this placeholder reward function before training.")


class OPDTrainer(GRPOTrainer):
    """On-policy distillation trainer. See `OPDConfig` for the OPD settings and the README for the metrics.

    Args:
        model: the student, as a path/Hub id or a model (optionally wrapped by `peft_config`).
        teacher_model: the frozen teacher, as a path/Hub id or a model. Defaults to `args.teacher_model_name_or_path`;
            leave it unset with `args.teacher_server_url` to score with vLLM servers instead.
        args: an `OPDConfig`.
        train_dataset / eval_dataset: prompt-only datasets with a `prompt` column (text or chat messages).
        processing_class: the student's tokenizer; loaded from the student's path when omitted.
        peft_config: a PEFT config to train an adapter instead of the full student.
        teacher_processing_class: the teacher's tokenizer, for the compatibility check; loaded from the teacher's
            path when omitted (and taken to be the student's for a teacher model with no path).
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
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        teacher_processing_class=None,
    ):
        student_name = model if isinstance(model, str) else get_config_model_id(model.config)
        if args is None:
            args = OPDConfig(output_dir=f"{student_name.split('/')[-1]}-OPD")
        if not isinstance(args, OPDConfig):
            raise TypeError(f"OPDTrainer needs an OPDConfig, got {type(args).__name__}.")
        check_prompt_dataset(train_dataset, name="train_dataset")
        for split, dataset in (eval_dataset.items() if isinstance(eval_dataset, dict) else [("", eval_dataset)]):
            check_prompt_dataset(dataset, name=f"eval_dataset{f'[{split!r}]' if split else ''}")

        teacher_model = args.teacher_model_name_or_path if teacher_model is None else teacher_model
        if teacher_model is not None and args.teacher_server_url:
            raise ValueError("Pass either a teacher model or `teacher_server_url`, not both.")
        if teacher_model is None and not args.teacher_server_url:
            raise ValueError(
                "OPDTrainer needs a teacher: pass `teacher_model=` (a path or a model), or set "
                "`teacher_model_name_or_path` or `teacher_server_url` in the OPDConfig."
            )
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(
                student_name, padding_side="left", truncation_side="left", trust_remote_code=args.trust_remote_code
            )
        teacher_batch_size = args.teacher_batch_size or args.per_device_train_batch_size
        if args.teacher_server_url:
            served_teacher = VLLMServerTeacher.from_env(
                args.teacher_server_url,
                api_key_env=args.teacher_server_api_key_env,
                batch_size=teacher_batch_size,
                timeout=(10.0, args.teacher_server_timeout),
                max_retries=args.teacher_server_max_retries,
            )
            served_teacher.connect(getattr(processing_class, "tokenizer", processing_class), student_name=student_name)
        else:
            teacher_model = self._check_and_load_teacher(
                model, teacher_model, args, student_name, processing_class, teacher_processing_class
            )

        super().__init__(
            model=model,
            reward_funcs=[_teacher_only],
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
        )
        self.reward_funcs, self.reward_func_names, self.reward_processing_classes = [], [], []
        self.reward_weights = torch.ones(0)

        if args.opd_objective == "importance_sampling":
            # clip(r, 0, inf) == r for r = exp(.) > 0, so GRPO's min(r A, clip(r) A) becomes r A exactly
            self.epsilon_low, self.epsilon_high = 1.0, float("inf")

        self.teacher: TeacherScorer
        if args.teacher_server_url:
            self.teacher_model, self.teacher = None, served_teacher
        else:
            self.teacher_model = self._prepare_teacher(freeze_teacher(teacher_model))
            self.teacher = LocalTeacher(
                self.teacher_model, batch_size=teacher_batch_size, autocast=self.accelerator.autocast
            )
        self._completion_tokens_total = 0
        self._window_tokens = 0
        self._window_start: float | None = None

    # ------------------------------------------------------------------ set-up

    @staticmethod
    def _check_and_load_teacher(model, teacher_model, args, student_name, processing_class, teacher_processing_class):
        """Check the pair fits before loading any weights, then load the teacher if it is a path."""
        teacher_name = teacher_model if isinstance(teacher_model, str) else get_config_model_id(teacher_model.config)
        student_tokenizer = getattr(processing_class, "tokenizer", processing_class)
        if teacher_processing_class is None:
            teacher_processing_class = (
                AutoTokenizer.from_pretrained(teacher_name, trust_remote_code=args.trust_remote_code)
                if teacher_name
                else student_tokenizer
            )
        check_tokenizers_compatible(
            student_tokenizer,
            getattr(teacher_processing_class, "tokenizer", teacher_processing_class),
            student_name=student_name,
            teacher_name=teacher_name,
        )

        def vocab_size(m) -> int:  # from the config alone: no weights are loaded yet
            remote = args.trust_remote_code
            config = AutoConfig.from_pretrained(m, trust_remote_code=remote) if isinstance(m, str) else m.config
            return config.get_text_config().vocab_size

        check_vocab_sizes(
            student_vocab_size=vocab_size(model),
            teacher_vocab_size=vocab_size(teacher_model),
            student_name=student_name,
            teacher_name=teacher_name,
        )
        if not isinstance(teacher_model, str):
            return teacher_model
        init_kwargs = dict(args.teacher_model_init_kwargs or {})
        init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        if args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
            init_kwargs["device_map"] = None  # "auto" fails under distributed training
        return create_model_from_path(teacher_model, **init_kwargs)

    def _prepare_teacher(self, teacher: torch.nn.Module) -> torch.nn.Module:
        """Place the teacher the way GRPO places its reference model: sharded under ZeRO-3/FSDP, else on device."""
        if self.is_deepspeed_enabled:
            return prepare_deepspeed(teacher, self.accelerator)
        if self.is_fsdp_enabled:
            return prepare_fsdp(teacher, self.accelerator)
        return self.accelerator.prepare_model(teacher, evaluation_mode=True)

    # ------------------------------------------------------------------ scoring

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        if self.reward_funcs:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        # GRPO gathers rewards across processes: an empty (global batch, 0) tensor yields zero reward advantages
        return torch.zeros(len(prompts) * self.accelerator.num_processes, 0, device=self.accelerator.device)

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        for name in _REWARD_METRICS:
            self._metrics[mode].pop(name, None)

        prompt_ids, prompt_mask = output["prompt_ids"], output["prompt_mask"]
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        mask = completion_mask * output["tool_mask"] if "tool_mask" in output else completion_mask  # (B, T)
        if output.get("old_per_token_logps") is None:
            old = self._student_logps(prompt_ids, prompt_mask, completion_ids, completion_mask)
            output["old_per_token_logps"] = old
        old_per_token_logps = output["old_per_token_logps"]  # (B, T)
        scores = self.teacher.score(prompt_ids, prompt_mask, completion_ids, completion_mask)
        self._check_finite(scores.logps, old_per_token_logps, mask)

        advantages = opd_advantages(
            scores.logps, old_per_token_logps, mask, coef=self.args.opd_coef, discount=self.args.kl_discount_factor
        )  # (B, T)
        output["advantages"] = advantages
        self._log_opd_metrics(mode, scores, old_per_token_logps, advantages, mask)
        return output

    def _student_logps(self, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
        """log pi_old of the sampled tokens, when GRPO did not already compute them (on-policy, no vLLM)."""
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model,
                torch.cat([prompt_ids, completion_ids], dim=1),
                torch.cat([prompt_mask, completion_mask], dim=1),
                completion_ids.size(1),
                batch_size=self.args.per_device_train_batch_size,
            )
        return logps

    def _check_finite(self, teacher_logps, old_logps, mask) -> None:
        """Fail, on every rank at once, if any scored token has a NaN/inf log-prob: never train on it silently."""
        mask = mask.bool()
        counts = torch.stack(
            [(~torch.isfinite(teacher_logps) & mask).sum(), (~torch.isfinite(old_logps) & mask).sum(), mask.sum()]
        )
        bad_teacher, bad_student, total = self.accelerator.reduce(counts, reduction="sum").tolist()
        if bad_teacher or bad_student:
            raise FloatingPointError(
                f"Step {self.state.global_step}: non-finite log-probs on sampled tokens (teacher: {bad_teacher}, "
                f"student: {bad_student}, of {total}). Training stopped rather than learn from them; the last "
                "checkpoint is intact. Check the teacher's dtype (float16 overflows) and its weights."
            )

    def _log_opd_metrics(self, mode, scores, old_per_token_logps, advantages, mask) -> None:
        sums = opd_metric_sums(
            teacher_per_token_logps=scores.logps,
            old_per_token_logps=old_per_token_logps,
            advantages=advantages,
            mask=mask,
            teacher_is_top1=scores.is_top1,
            teacher_entropy=scores.entropy,
        )
        num_sequences = torch.tensor(float(mask.size(0)), device=sums.device)
        sums = self.accelerator.reduce(torch.cat([sums, num_sequences[None]]), reduction="sum")
        sums, num_sequences = sums[:-1], sums[-1].item()
        for name, value in opd_metrics_from_sums(sums).items():
            self._metrics[mode][name].append(value)
        num_tokens = int(sums[0].item())
        self._metrics[mode]["data/completion_tokens_mean"].append(num_tokens / max(num_sequences, 1.0))
        if mode == "train":
            self._completion_tokens_total += num_tokens
            self._window_tokens += num_tokens

        # GRPO filled the completions table with the (zero) reward advantages of this batch: show the teacher's
        sequence_advantage = (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        gathered = self.accelerator.gather(sequence_advantage).tolist()
        for _ in gathered:
            self._logs["advantages"].pop()
        self._logs["advantages"].extend(gathered)

    # ------------------------------------------------------------------ logging

    def training_step(self, model, inputs, num_items_in_batch):
        if self._window_start is None:
            self._window_start = time.perf_counter()
        return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training and self._window_tokens and self._window_start is not None:
            now = time.perf_counter()
            logs["data/completion_tokens_per_second"] = self._window_tokens / (now - self._window_start)
            logs["data/completion_tokens_total"] = self._completion_tokens_total
            self._window_tokens, self._window_start = 0, now
        super().log(logs, start_time)
