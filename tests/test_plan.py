"""OPDPlan: what a run does, decided once from the config and GRPO's set-up (`trl_opd/trainer/plan.py`)."""

from types import SimpleNamespace

import pytest

from trl_opd.trainer.plan import OPDPlan


def _grpo(**overrides):
    """The attributes of GRPO's trainer the plan reads, as GRPO's constructor sets them for a plain CPU run."""
    values = dict(beta=0.0, _entropy_bonus_enabled=False, aux_loss_enabled=False, use_vllm=False,
                  vllm_importance_sampling_correction=True, accelerator=SimpleNamespace(device=SimpleNamespace(
                      type="cpu")))
    return SimpleNamespace(**{**values, **overrides})


def _plan(make_config, rewards=False, grpo=None, **options):
    args = make_config(**{"opd_estimator": "full", **options})  # the default for a local teacher
    args = args.resolved(None)
    return OPDPlan.resolve(args, source=args.teacher_source() or "local", rewards=rewards, grpo=grpo or _grpo())


def test_the_default_local_run_forms_its_advantages_in_the_loss_forward(make_config, tiny):
    plan = _plan(make_config, teacher_model_name_or_path=str(tiny / "teacher"))
    assert (plan.estimator, plan.divergence, plan.dense_weight) == ("full", "reverse_kl", 1.0)
    assert plan.advantages_in_loss_forward and plan.policy_term_zero and plan.compact_logps
    assert (plan.rewards, plan.combination, plan.overlap) == (False, None, False)


@pytest.mark.parametrize("options, why", [
    (dict(num_iterations=2), "a second pass over each batch is off-policy"),
    (dict(steps_per_generation=2, gradient_accumulation_steps=1), "two optimizer steps per generation batch"),
])
def test_where_the_sampling_policy_is_not_the_loss_forwards_advantages_are_formed_at_generation(
        make_config, tiny, options, why):
    plan = _plan(make_config, teacher_model_name_or_path=str(tiny / "teacher"), **options)
    assert not plan.advantages_in_loss_forward, why
    assert not plan.policy_term_zero, why  # GRPO's ratio differs from 1 there: its policy term counts


@pytest.mark.parametrize("grpo, term", [(_grpo(beta=0.1), "a KL penalty"),
                                        (_grpo(_entropy_bonus_enabled=True), "an entropy bonus"),
                                        (_grpo(aux_loss_enabled=True), "the MoE auxiliary loss")])
def test_any_other_term_of_grpos_loss_keeps_the_policy_term(make_config, tiny, grpo, term):
    plan = _plan(make_config, grpo=grpo, teacher_model_name_or_path=str(tiny / "teacher"))
    assert not plan.policy_term_zero, term
    assert plan.compact_logps == (term == "a KL penalty")  # the entropy's gradient and the MoE loss need GRPO's head


def test_rewards_combine_as_configured_and_scale_the_dense_term(make_config, tiny):
    plan = _plan(make_config, rewards=True, teacher_model_name_or_path=str(tiny / "teacher"), num_generations=2,
                 opd_reward_combination="loss", opd_loss_coef=0.5, opd_dense_coef=2.0)
    assert (plan.combination, plan.dense_weight, plan.policy_term_zero) == ("loss", 1.0, False)
    plan = _plan(make_config, rewards=True, teacher_model_name_or_path=str(tiny / "teacher"), num_generations=2,
                 opd_reward_combination="advantage", opd_estimator="sampled")
    assert (plan.combination, plan.dense_weight, plan.divergence) == ("advantage", 0.0, None)


def test_vllm_importance_sampling_is_kept_only_where_the_policy_term_counts(make_config, tiny):
    vllm = _grpo(use_vllm=True)
    dense_alone = _plan(make_config, grpo=vllm, teacher_model_name_or_path=str(tiny / "teacher"))
    assert not dense_alone.vllm_importance_sampling and dense_alone.advantages_in_loss_forward
    sampled = _plan(make_config, grpo=vllm, teacher_model_name_or_path=str(tiny / "teacher"), opd_estimator="sampled")
    assert sampled.vllm_importance_sampling and not sampled.advantages_in_loss_forward


def test_the_plan_describes_every_decision_on_its_own_line(make_config, tiny):
    plan = _plan(make_config, teacher_model_name_or_path=str(tiny / "teacher"))
    lines = plan.describe().splitlines()
    assert [line.split()[0] for line in lines] == list(vars(plan))
    assert lines[0].split() == ["teacher_source", "local"]


def test_the_advantage_is_zero_by_construction_only_without_opd_coef_and_summed_reward_advantages(make_config, tiny):
    teacher = {"teacher_model_name_or_path": str(tiny / "teacher")}
    assert _plan(make_config, **teacher).advantage_zero  # 'full' alone: opd_coef 0
    assert not _plan(make_config, opd_coef=0.5, **teacher).advantage_zero
    assert not _plan(make_config, rewards=True, opd_reward_combination="advantage", **teacher).advantage_zero
    assert _plan(make_config, rewards=True, opd_reward_combination="loss", **teacher).advantage_zero
    assert not _plan(make_config, opd_estimator="sampled", **teacher).advantage_zero  # opd_coef 1
