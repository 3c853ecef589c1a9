"""What a run does, decided once: `OPDPlan`, built by the trainer when GRPO's set-up is done and read by every part of
the step instead of re-deriving it from the config and GRPO's attributes.

It is printed at the start of training and shown by `trl-opd check`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..loss import divergence_name


@dataclass(frozen=True)
class OPDPlan:
    teacher_source: str  # local, served, reference, routed or self (`OPDConfig.teacher_source`)
    estimator: str  # sampled, topk or full (`opd_estimator`)
    divergence: str | None  # the dense term's (reverse_kl, forward_kl or jsd); None for the sampled estimator
    dense_weight: float  # the dense term's weight in the loss: 0 without one, or with the teacher switched off
    rewards: bool  # reward functions (or an environment's `get_reward`) join the teacher's signal
    combination: str | None  # with rewards: "advantage" (summed advantages) or "loss" (L_RL + coef * L_OPD)
    byte_credit: bool  # a cross-tokenizer teacher credited by bytes: its advantage needs the sampler's prefixes too
    advantages_in_loss_forward: bool  # formed from the loss forward's log-probs (else at generation: see below)
    policy_term_zero: bool  # GRPO's policy loss is 0 on every batch whose advantages the loss forward forms
    advantage_zero: bool  # the advantage is 0 by construction (opd_coef 0, no reward advantage summed in): not logged
    constant_advantage: bool  # a control run: the teacher's advantages replaced by -mean|A| (opd_constant_advantage)
    compact_logps: bool  # the loss forward projects the completion positions only (`student.py`)
    overlap: bool  # training batches scored while the student updates on the one before (`overlap.py`)
    vllm_importance_sampling: bool  # GRPO's correction of vLLM's sampling, kept only where its policy term counts

    @classmethod
    def resolve(cls, args, *, source: str, rewards: bool, grpo) -> OPDPlan:
        """The plan of a run with `args` and a teacher from `source`, once GRPO's constructor has set `grpo`'s
        attributes (its KL weight, entropy bonus, MoE auxiliary loss, vLLM importance sampling, device)."""
        generate_every = args.steps_per_generation * args.num_iterations
        on_policy = args.gradient_accumulation_steps % generate_every == 0  # each batch trained once, in one step
        no_other_term = grpo.beta == 0.0 and not grpo._entropy_bonus_enabled and not grpo.aux_loss_enabled
        dense = args.opd_dense_coef is not None
        # GRPO computes no old log-probs when the sampling policy is the one the loss forward runs (its loss takes the
        # forward's own, detached); the teacher's advantage is then formed there too, unless it needs more of the
        # sampling policy (the byte credit needs its final states)
        policy_term_zero = args.opd_coef == 0.0 and dense and not rewards and no_other_term and on_policy
        # vLLM's importance-sampling correction reweights GRPO's policy term: where a dense term alone makes that 0,
        # its extra forward for the old log-probs would buy nothing (the sampler's gap is logged from the loss forward)
        importance_sampling = grpo.use_vllm and grpo.vllm_importance_sampling_correction and not policy_term_zero
        grpo_old_logps = not on_policy or importance_sampling
        # the control's constant is a mean over the whole generation batch: where GRPO splits that batch into several
        # micro-batches, each loss forward would see only its own, so it is formed at generation, from one more
        # no-grad forward of the student
        split_control = args.opd_constant_advantage and args.steps_per_generation > 1
        return cls(
            teacher_source=source,
            estimator=args.opd_estimator,
            divergence=divergence_name(args.opd_divergence_beta) if dense else None,
            dense_weight=(args.opd_dense_coef * (args.opd_loss_coef if rewards else 1.0)) if dense else 0.0,
            rewards=rewards,
            combination=args.opd_reward_combination if rewards else None,
            byte_credit=args.byte_credit,
            advantages_in_loss_forward=not grpo_old_logps and not args.byte_credit and not split_control,
            policy_term_zero=policy_term_zero,
            advantage_zero=args.opd_coef == 0.0 and not (rewards and args.opd_reward_combination == "advantage"),
            constant_advantage=args.opd_constant_advantage,
            compact_logps=grpo.accelerator.device.type == "cpu" and not grpo.aux_loss_enabled
            and not grpo._entropy_bonus_enabled,
            overlap=args.opd_overlap_scoring,
            vllm_importance_sampling=importance_sampling,
        )

    def describe(self) -> str:
        """One line per decision, for the log at the start of training and `trl-opd check`."""
        width = max(map(len, asdict(self)))
        return "\n".join(f"  {name:<{width}}  {value}" for name, value in asdict(self).items())
