"""The control run (`opd_constant_advantage`): the teacher's per-token advantages replaced by their mean magnitude,
negated, on every distilled token; the teacher's scores and the logged KL are the run's own."""

import pytest
import torch

from trl_opd import OPDTrainer
from trl_opd.loss import constant_negative_advantages


def test_the_constant_is_minus_the_mean_magnitude_over_the_masked_tokens():
    advantages = torch.tensor([[0.5, -1.5, 9.0], [-2.0, 0.0, 4.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    expected_constant = -(0.5 + 1.5 + 2.0 + 0.0 + 4.0) / 5
    out = constant_negative_advantages(advantages, mask)
    torch.testing.assert_close(out, torch.tensor([[expected_constant] * 2 + [0.0], [expected_constant] * 3]))
    # NaN where the mask is 0 (padding is never scored) does not reach the constant
    with_nan = advantages.clone()
    with_nan[0, 2] = float("nan")
    torch.testing.assert_close(constant_negative_advantages(with_nan, mask), out)


def test_the_mean_is_over_every_process_s_tokens():
    # a second process held 3 tokens of magnitude 10 in all: the sum over processes adds its (30, 3)
    advantages, mask = torch.tensor([[1.0, -3.0]]), torch.tensor([[1, 1]])
    out = constant_negative_advantages(advantages, mask,
                                       sum_over_processes=lambda totals: totals + torch.tensor([30.0, 3.0]))
    torch.testing.assert_close(out, torch.full((1, 2), -(4.0 + 30.0) / (2 + 3)))


def _teacher_logps(trainer, batch):
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].size(1)
    with torch.no_grad():
        logits = trainer.teacher_model(input_ids=ids, attention_mask=attention).logits[:, -width - 1 : -1]
    return logits.log_softmax(-1).gather(-1, batch["completion_ids"][..., None]).squeeze(-1)


def test_formed_at_generation_every_distilled_token_gets_minus_the_mean_magnitude(tiny, prompts, make_config):
    # two passes over each batch: GRPO computes the old log-probs and the advantage is formed at generation
    trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), train_dataset=prompts,
                         args=make_config(max_steps=1, num_iterations=2, opd_estimator="sampled",
                                          opd_coef=0.5, opd_constant_advantage=True))
    assert trainer.plan.constant_advantage
    batch = trainer._generate_and_score_completions([dict(prompts[i]) for i in range(4)])
    mask = batch["action_mask"].bool()
    teacher_advantages = 0.5 * (_teacher_logps(trainer, batch) - batch["old_per_token_logps"])
    constant = -teacher_advantages[mask].abs().mean()
    assert constant < -1e-3  # the tiny student is not its teacher: there is a signal to replace
    expected = torch.where(mask, constant, torch.zeros_like(constant))
    torch.testing.assert_close(batch["advantages"], expected, atol=1e-4 * abs(constant.item()), rtol=1e-4)


def test_a_generation_batch_of_several_micro_batches_gets_one_constant_over_all_of_them(tiny, prompts,
                                                                                       make_config):
    # 2 micro-batches of 4 rows a generation, trained in one step: the plain run forms its advantages in each loss
    # forward, the control at generation, where the whole batch of 8 is at hand (each loss forward sees only its 4)
    options = dict(max_steps=1, gradient_accumulation_steps=2, opd_estimator="sampled")
    plain = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), train_dataset=prompts,
                       args=make_config(**options))
    assert plain.plan.advantages_in_loss_forward
    trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), train_dataset=prompts,
                         args=make_config(**options, opd_constant_advantage=True))
    assert not trainer.plan.advantages_in_loss_forward
    batches, generate = [], trainer._generate_and_score_completions

    def recording(inputs):
        batches.append(generate(inputs))
        return batches[-1]

    trainer._generate_and_score_completions = recording
    trainer.train()
    assert len(batches) == 1 and batches[0]["completion_ids"].size(0) == 8
    batch = batches[0]
    mask = batch["action_mask"].bool()
    teacher_advantages = _teacher_logps(trainer, batch) - batch["old_per_token_logps"]  # opd_coef 1
    # the trained step moved the student, not the teacher; the old log-probs are the sampling policy's own
    constant = -teacher_advantages[mask].abs().mean()
    halves = [-teacher_advantages[:4][mask[:4]].abs().mean(), -teacher_advantages[4:][mask[4:]].abs().mean()]
    assert abs(halves[0] - halves[1]) > 1e-3 * abs(constant)  # a mean per micro-batch would be another number
    torch.testing.assert_close(batch["advantages"], torch.where(mask, constant, 0.0),
                               atol=1e-4 * abs(constant.item()), rtol=1e-4)


def test_formed_in_the_loss_forward_the_control_keeps_the_run_s_kl_and_changes_its_update(tiny, prompts,
                                                                                         make_config):
    runs = {}
    for control in (False, True):
        config = make_config(max_steps=1, opd_estimator="sampled", opd_constant_advantage=control)
        trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=config,
                             train_dataset=prompts)
        formed, form = [], trainer._form_advantages

        def recording(inputs, old_per_token_logps, form=form, formed=formed):
            form(inputs, old_per_token_logps)
            formed.append((inputs["advantages"].clone(), inputs["teacher_per_token_logps"], old_per_token_logps,
                           inputs["action_mask"].bool()))

        trainer._form_advantages = recording
        before = torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters() if p.requires_grad])
        trainer.train()
        assert len(formed) == 1  # the advantage was formed in the loss forward
        after = torch.cat([p.detach().flatten() for p in trainer.model.parameters() if p.requires_grad])
        runs[control] = trainer.state.log_history[0], formed[0], after - before
    (plain, _, plain_update), (control, (advantages, teacher, old, mask), control_update) = runs[False], runs[True]
    constant = -(teacher - old)[mask].abs().mean()  # opd_coef 1
    torch.testing.assert_close(advantages, torch.where(mask, constant, 0.0), atol=1e-5 * abs(constant.item()),
                               rtol=1e-5)
    # the same seed samples the same first batch: the teacher's scores and the KL logged are the control's too
    assert control["opd/reverse_kl"] == pytest.approx(plain["opd/reverse_kl"], rel=1e-5)
    assert control["opd/advantage_mean"] == pytest.approx(constant.item(), rel=1e-5)
    assert plain["opd/advantage_mean"] != pytest.approx(control["opd/advantage_mean"], rel=1e-2)
    # and the update differs: the same tokens, pushed by another advantage (the norms alone may happen to agree)
    assert (control_update - plain_update).norm() > 1e-2 * plain_update.norm() > 0


@pytest.mark.parametrize("case", ["dense estimator", "rewards"])
def test_the_control_is_refused_where_the_teacher_s_signal_would_stay(tiny, prompts, make_config, case):
    options = {"opd_estimator": "full"} if case == "dense estimator" else {"opd_estimator": "sampled",
                                                                           "num_generations": 2}
    rewards = [lambda completions, **kwargs: [1.0] * len(completions)] if case == "rewards" else None
    match = "dense term" if case == "dense estimator" else "reward functions"
    with pytest.raises(ValueError, match=f"opd_constant_advantage.*{match}"):
        OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), train_dataset=prompts,
                   reward_funcs=rewards, args=make_config(opd_constant_advantage=True, **options))


def test_the_model_card_says_the_run_was_a_control():
    from trl_opd.trainer.hub import objective_text

    text = objective_text({"opd_estimator": "sampled", "opd_coef": 1.0, "opd_constant_advantage": True})
    assert text.startswith("A control run") and "was not trained on" in text
    assert "control" not in objective_text({"opd_estimator": "sampled", "opd_coef": 1.0})
