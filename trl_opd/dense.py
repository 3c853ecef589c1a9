"""The dense terms of the 'topk' and 'full' estimators, added to GRPO's policy loss on the same student forward.

The student's final hidden states are taken from its one loss forward (a hook on the backbone); the teacher's side
was kept from its single scoring pass (hidden states for 'full', top-k ids and log-probs for 'topk').

With a dense term alone (`opd_coef` 0, no reward functions, no KL or entropy term), GRPO's policy loss is exactly 0:
its vocabulary projection, log-softmax and backward would be spent on nothing. Then the student's forward stops at
the hidden states, the dense term is the whole loss, and the metrics that GRPO's forward would have given (the
sampled tokens' log-probs, the entropy) come from one no-grad projection in tiles.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
from trl.models.utils import _ForwardRedirection

from .heads import OutputHead, head_token_stats
from .loss import aggregate_as_loss_type, dense_divergence, dense_topk_divergence, divergence_name
from .student import MULTIMODAL_INPUTS
from .teachers.base import TeacherScores


class _ForwardOnly:
    """Calls `module.forward` without `module`'s hooks: for a call inside the forward that already ran them."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return self.module.forward(*args, **kwargs)


class DenseLossMixin:
    """Mixed into OPDTrainer before GRPOTrainer. Reads GRPO's `args`, `accelerator`, `model`, `_metrics`, `beta`,
    `reward_funcs`, `temperature`, `_entropy_bonus_enabled` and `aux_loss_enabled`, the trainer's `teacher`, and
    calls the methods declared at the end, which other bases of OPDTrainer provide."""

    _forward_redirection = _ForwardRedirection()
    _teacher_head_held: ExitStack | None = None  # open through a training step's loss and backward (`training_step`)

    def training_step(self, model, inputs, num_items_in_batch):
        with ExitStack() as self._teacher_head_held:
            try:
                return super().training_step(model, inputs, num_items_in_batch)
            finally:
                self._teacher_head_held = None

    def _whole_teacher_heads(self) -> tuple[OutputHead, ...]:
        """The teacher's head for the full term (routed teachers: each one's, in `TeacherScores.hidden_route`'s
        order), gathered once per training step under ZeRO-3 and held whole until its backward is done (TRL's
        divergence kernel would gather it again for each call of at most 4096 positions, forward and backward: some
        120 GB of all-gathers a step for an 8B teacher at the flagship's batch). A head that is the student's own
        parameter (a self-teacher's) is left to the kernel: the student's forward and its gradient reduction manage
        it."""
        heads = getattr(self.teacher, "output_heads", None) or (self.teacher.output_head,)
        for head in heads:
            if self._teacher_head_held is not None and hasattr(head.weight, "ds_id") and not (
                    self._is_student_parameter(head)):
                self._teacher_head_held.enter_context(head.gathered())  # a no-op once gathered: one gather per step
        return heads

    def _is_student_parameter(self, head: OutputHead) -> bool:
        student = self.accelerator.unwrap_model(self.model)
        return any(parameter is head.weight for parameter in student.parameters())

    def _keep_dense_inputs(self, output, scores: TeacherScores) -> None:
        if self._dense_weight == 0.0:
            return  # the teacher is switched off (opd_loss_coef 0 beside rewards): no dense term, nothing to keep
        self._expect_dense_rows("train" if self.model.training else "eval", output["completion_ids"].size(0))
        if scores.hidden is not None:
            output["teacher_hidden_states"] = scores.hidden  # (B, T, H_teacher), for the full estimator's term
        if scores.hidden_route is not None:
            output["teacher_route"] = scores.hidden_route  # (B,) routed teachers: whose head projects each row
        if scores.topk_ids is not None:
            output["teacher_topk_ids"] = scores.topk_ids  # (B, T, k), for the topk estimator's term
            output["teacher_topk_logps"] = scores.topk_logps  # (B, T, k)

    @staticmethod
    def _has_dense_term(inputs) -> bool:
        """The batch kept the teacher's side of a dense term (`_keep_dense_inputs`)."""
        return "teacher_hidden_states" in inputs or "teacher_topk_ids" in inputs

    def _dense_and_policy_loss(self, model, inputs):
        if not self._has_dense_term(inputs) and not self._compact_logps_apply(inputs):
            return self._policy_loss(model, inputs)
        # The whole loss runs inside the student's forward (TRL's forward redirection, as its distillation trainer
        # does): DDP then prepares its backward once, and under ZeRO-3 the LM head, which the dense term reads
        # directly, is gathered on access and stays registered to the model for the backward, where ZeRO reduces its
        # gradient. Inside, the student is called through its `forward`: its hooks already ran for this call. The same
        # holds for the student's log-probs projected at the completion only (`student.py`), which read the head too.
        unwrapped = self.accelerator.unwrap_model(model)
        return self._forward_redirection(model, unwrapped, self._loss_inside_forward, _ForwardOnly(unwrapped), inputs)

    def _loss_inside_forward(self, model, inputs):
        student = self._student_causal_lm()
        if self._policy_loss_is_zero(inputs):
            # the dense term is the whole loss: the backbone alone, no vocabulary projection but the dense term's
            input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            with self.accelerator.autocast():
                hidden = student.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            hidden = hidden.last_hidden_state
            self._log_lean_forward_metrics(inputs, hidden, student)
            return self._dense_weight * self._dense_loss(inputs, hidden, student)
        if not self._has_dense_term(inputs):
            return self._policy_loss(model, inputs)  # no dense term: GRPO's loss, its log-probs compact
        hidden = []
        hook = student.base_model.register_forward_hook(lambda m, a, out: hidden.append(out.last_hidden_state))
        try:
            loss = self._policy_loss(model, inputs)
        finally:
            hook.remove()
        return loss + self._dense_weight * self._dense_loss(inputs, hidden[0], student)

    def _policy_loss_is_zero(self, inputs) -> bool:
        """Zero advantages (a dense term alone), formed in this forward (see `advantages`), and no other term in
        GRPO's loss."""
        return (self.args.opd_coef == 0.0 and not self.reward_funcs and "teacher_per_token_logps" in inputs
                and self._no_other_grpo_loss_term() and not any(key in inputs for key in MULTIMODAL_INPUTS))

    def _no_other_grpo_loss_term(self) -> bool:
        """GRPO's loss has no KL penalty, entropy bonus or MoE auxiliary term: with zero advantages it is 0."""
        return self.beta == 0.0 and not self._entropy_bonus_enabled and not self.aux_loss_enabled

    def _log_lean_forward_metrics(self, inputs, student_hidden, student) -> None:
        """What GRPO's loss forward would have given: the (zero) advantages and the deferred `opd/*` metrics, from the
        sampled tokens' log-probs, which on-policy are the old ones, and the student's `entropy`, over the distilled
        tokens."""
        completion_ids, mask = inputs["completion_ids"], inputs["action_mask"]
        valid = mask.bool()  # only these positions are projected onto the vocabulary
        hidden = student_hidden[:, -completion_ids.size(1) - 1 : -1].detach()
        valid_logps, valid_entropy, _ = head_token_stats(hidden[valid], self._student_head(student),
                                                         completion_ids[valid])
        logps = valid_logps.new_zeros(mask.shape).masked_scatter(valid, valid_logps)
        self._use_loss_forward_logps(inputs, logps)
        mode = "train" if self.model.training else "eval"
        # GRPO's `entropy` exactly (its `_compute_loss` logs each micro-batch's token mean over all processes), so a
        # run logs one `entropy` whichever path: redefining it would mean rewriting the value GRPO's loss has already
        # logged on its own path (tests/test_trl_hooks.py pins its formula)
        totals = self.accelerator.reduce(torch.stack([valid_entropy.sum(), mask.sum().float()]), "sum")
        self._metrics[mode]["entropy"].append((totals[0] / totals[1].clamp(min=1.0)).item())

    @property
    def _dense_weight(self) -> float:
        """The dense term's weight: `opd_dense_coef`, times `opd_loss_coef` when rewards are mixed in, so that one
        coefficient scales (or, at 0, switches off) the whole teacher signal."""
        if self.args.opd_dense_coef is None:  # the sampled estimator: no dense term
            return 0.0
        return self.args.opd_dense_coef * (self.args.opd_loss_coef if self.reward_funcs else 1.0)

    def _dense_loss(self, inputs, student_hidden, student) -> torch.Tensor:
        """The divergence of `opd_divergence_beta` (the reverse KL by default) over the vocabulary ('full': exact;
        'topk': the teacher's top-k plus a tail bucket) at every completion position, aggregated as GRPO's `loss_type`
        aggregates its policy term (`_aggregate_as_policy_loss`), so the two add on the same scale."""
        mode = "train" if self.model.training else "eval"
        num_completion = inputs["completion_ids"].size(1)
        mask = inputs["action_mask"]  # the tokens the student sampled (see multiturn.action_mask)
        student_hidden, student_head = student_hidden[:, -num_completion - 1 : -1], self._student_head(student)
        beta = self.args.opd_divergence_beta
        if "teacher_topk_ids" in inputs:
            per_token, mass = dense_topk_divergence(
                student_hidden, student_head, inputs["teacher_topk_ids"], inputs["teacher_topk_logps"], mask, beta=beta,
                with_mass=True,
            )  # (B, T), (2, positions): how much of each distribution the top-k term sees
            sums = {f"opd/{divergence_name(beta)}_topk": per_token.sum(), "opd/student_topk_mass": mass[0].sum(),
                    "opd/teacher_topk_mass": mass[1].sum()}
        else:
            # routed teachers: each head over its own rows (the others masked out), on every process alike
            route = inputs.get("teacher_route")
            teacher_hidden = inputs["teacher_hidden_states"]
            per_token = sum(  # routed states are padded to the widest teacher: each head reads its own width
                dense_divergence(student_hidden, student_head, teacher_hidden[..., : head.hidden_size], head,
                                 mask if route is None else mask.bool() & (route == number)[:, None], beta=beta)
                for number, head in enumerate(self._whole_teacher_heads())
            )  # (B, T)
            sums = {f"opd/{divergence_name(beta)}_dense": per_token.sum()}
        self._log_dense_sums(mode, sums, mask.sum(), rows=mask.size(0))
        return self._aggregate_as_policy_loss(per_token, mask, inputs, mode)

    def _aggregate_as_policy_loss(self, per_token, mask, inputs, mode: str) -> torch.Tensor:
        """`per_token` (B, T), 0 off `mask`, summed into a loss as GRPO's `loss_type` sums its policy term (and for
        gradient accumulation alike), so that the two add on one scale whichever the `loss_type`."""
        training = mode == "train"
        return aggregate_as_loss_type(
            per_token, mask, loss_type=self.loss_type,
            accumulation=self.current_gradient_accumulation_steps if training else 1.0,
            max_completion_length=self.max_completion_length,
            num_items_in_batch=inputs.get("num_items_in_batch"), num_processes=self.accelerator.num_processes,
            micro_steps_per_generation=self.args.steps_per_generation if training else 1.0,
        )

    # ------------------------------------------------------------------ provided by OPDTrainer's other bases

    def _policy_loss(self, model, inputs) -> torch.Tensor:
        """GRPO's loss on the batch's advantages (`policy.PolicyObjectiveMixin`)."""
        raise NotImplementedError

    def _student_head(self, student) -> OutputHead:
        """The student's LM head at the sampling temperature (`student.StudentMixin`)."""
        raise NotImplementedError

    def _student_causal_lm(self):
        """The student without its PEFT or distributed wrappers (`student.StudentMixin`)."""
        raise NotImplementedError

    def _compact_logps_apply(self, inputs) -> bool:
        """Whether the loss forward's log-probs are projected at the completion only (`student.StudentMixin`)."""
        raise NotImplementedError

    def _expect_dense_rows(self, mode: str, rows: int) -> None:
        """A generation batch of `rows` rows with a dense term begins (`metrics.OPDMetricsMixin`)."""
        raise NotImplementedError

    def _log_dense_sums(self, mode: str, sums: dict, count, rows: int) -> None:
        """A micro-batch's share of its generation batch's dense-term metrics (`metrics.OPDMetricsMixin`)."""
        raise NotImplementedError

    def _use_loss_forward_logps(self, inputs, old) -> None:
        """A micro-batch's advantages and `opd/*` metrics from the loss forward's log-probs `old`
        (`advantages.AdvantagesMixin`)."""
        raise NotImplementedError
