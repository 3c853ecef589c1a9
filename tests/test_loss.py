"""The OPD math by hand: three-token examples whose expected values are worked out in the comments."""

import math

import pytest
import torch

from trl_opd.loss import discounted_future_sum, opd_advantages, opd_metric_sums, opd_metrics_from_sums


def test_advantage_is_scaled_teacher_minus_student_and_masked():
    teacher = torch.tensor([[-1.0, -2.0, -3.0]])
    old = torch.tensor([[-2.0, -2.0, -1.0]])
    mask = torch.tensor([[1, 1, 0]])
    # 0.5 * (teacher - old) = [0.5, 0, -1], the last one masked to 0
    assert opd_advantages(teacher, old, mask, coef=0.5).tolist() == [[0.5, 0.0, 0.0]]


def test_identical_student_and_teacher_give_zero_advantage_and_zero_kl():
    logps = torch.tensor([[-0.3, -2.5, -1.0], [-4.0, -0.1, -0.2]])
    mask = torch.ones(2, 3)
    advantages = opd_advantages(logps, logps.clone(), mask)
    assert torch.equal(advantages, torch.zeros(2, 3))
    metrics = opd_metrics_from_sums(
        opd_metric_sums(teacher_per_token_logps=logps, old_per_token_logps=logps, advantages=advantages, mask=mask)
    )
    assert metrics["opd/reverse_kl"] == 0.0 and metrics["opd/reverse_kl_std"] == 0.0
    assert metrics["opd/teacher_logp"] == pytest.approx(logps.mean().item())


def test_all_masked_row_gives_no_nan_even_if_its_logps_are_garbage():
    teacher = torch.tensor([[-1.0, -1.0], [math.nan, -math.inf]])
    old = torch.tensor([[-2.0, -3.0], [math.inf, math.nan]])
    mask = torch.tensor([[1, 1], [0, 0]])
    advantages = opd_advantages(teacher, old, mask, discount=0.9)
    assert torch.isfinite(advantages).all()
    assert advantages[1].tolist() == [0.0, 0.0]
    # gamma 0.9 on [1, 2]: [1 + 0.9 * 2, 2]
    assert advantages[0].tolist() == pytest.approx([2.8, 2.0])
    metrics = opd_metrics_from_sums(
        opd_metric_sums(teacher_per_token_logps=teacher, old_per_token_logps=old, advantages=advantages, mask=mask)
    )
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["opd/reverse_kl"] == pytest.approx(-1.5)  # old - teacher = [-1, -2] on the unmasked row


def test_discounted_future_sum_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0]])
    # t=2: 3; t=1: 2 + 0.5 * 3 = 3.5; t=0: 1 + 0.5 * 2 + 0.25 * 3 = 2.75
    assert discounted_future_sum(values, torch.ones(1, 3, dtype=torch.bool), gamma=0.5).tolist() == [[2.75, 3.5, 3.0]]


def test_discount_steps_over_actions_only_not_observation_tokens():
    # two student turns (actions at 0 and 3) around a two-token observation (1, 2): one action later, one gamma
    teacher = torch.tensor([[0.0, 5.0, 5.0, 0.0]])
    old = torch.tensor([[-1.0, 0.0, 0.0, -1.0]])
    mask = torch.tensor([[1, 0, 0, 1]])
    # per-token A = [1, 0, 0, 1]; t=3: 1; t=0: 1 + 0.5 * 1 = 1.5 (the old scan gave 1 + 0.5^3 = 1.125)
    assert opd_advantages(teacher, old, mask, discount=0.5).tolist() == [[1.5, 0.0, 0.0, 1.0]]


def test_discount_does_not_carry_padding_and_zero_discount_is_off():
    teacher = torch.tensor([[0.0, 0.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -7.0]])
    mask = torch.tensor([[1, 1, 0]])
    # per-token A = [1, 2, (masked) 0]; discounted with 0.5: [1 + 0.5 * 2, 2, 0]
    assert opd_advantages(teacher, old, mask, discount=0.5).tolist() == [[2.0, 2.0, 0.0]]
    assert opd_advantages(teacher, old, mask, discount=0.0).tolist() == [[1.0, 2.0, 0.0]]


def test_metrics_by_hand():
    teacher = torch.tensor([[-1.0, -2.0, -4.0, -9.0]])
    old = torch.tensor([[-2.0, -2.0, -1.0, -9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    is_top1 = torch.tensor([[True, False, False, True]])
    entropy = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    advantages = opd_advantages(teacher, old, mask)
    metrics = opd_metrics_from_sums(
        opd_metric_sums(
            teacher_per_token_logps=teacher, old_per_token_logps=old, advantages=advantages, mask=mask,
            teacher_is_top1=is_top1, teacher_entropy=entropy,
        )
    )
    # old - teacher on the 3 unmasked tokens: [-1, 0, 3] -> mean 2/3, population std sqrt(10/3 - 4/9)
    assert metrics["opd/reverse_kl"] == pytest.approx(2 / 3)
    assert metrics["opd/reverse_kl_std"] == pytest.approx(math.sqrt(10 / 3 - 4 / 9))
    assert metrics["opd/advantage_mean"] == pytest.approx(-2 / 3)
    assert metrics["opd/teacher_logp"] == pytest.approx(-7 / 3)
    assert metrics["opd/student_logp"] == pytest.approx(-5 / 3)
    assert metrics["opd/teacher_agreement"] == pytest.approx(1 / 3)
    assert metrics["opd/teacher_entropy"] == pytest.approx(2.0)


def test_metrics_of_an_empty_batch_are_absent_and_unknown_fields_are_left_out():
    zeros = torch.zeros(1, 2)
    sums = opd_metric_sums(teacher_per_token_logps=zeros, old_per_token_logps=zeros, advantages=zeros, mask=zeros)
    assert opd_metrics_from_sums(sums) == {}
    sums = opd_metric_sums(
        teacher_per_token_logps=zeros, old_per_token_logps=zeros, advantages=zeros, mask=torch.ones(1, 2)
    )
    assert "opd/teacher_agreement" not in opd_metrics_from_sums(sums)


def test_a_term_is_summed_as_each_loss_type_sums_grpos_policy_term():
    from trl_opd.loss import LOSS_TYPES, aggregate_as_loss_type

    # two sequences: [1, 2] (both tokens valid) and [3, 0] (one valid); 3 tokens in all, the longest completion 4
    per_token = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    common = dict(accumulation=2.0, max_completion_length=4, num_items_in_batch=torch.tensor(12.0), num_processes=2,
                  micro_steps_per_generation=4.0)
    expected = {
        "grpo": (1.5 + 3.0) / 2 / 2,  # sequence means 1.5 and 3, their mean 2.25, over 2 accumulation steps
        "sapo": (1.5 + 3.0) / 2 / 2,
        "bnpo": 6.0 / 3 / 2,  # 6 over the micro-batch's 3 tokens, over 2
        "dr_grpo": 6.0 / (2 * 4) / 2,  # 6 over 2 sequences x 4 tokens, over 2
        "luspo": (3.0 + 3.0) / 2 / 2,  # sequence sums 3 and 3, their mean, over 2
        # 6 over the generation batch's 12 tokens / 2 processes = 6 a process, times 2 / 4 of it a step: 6 / 3 = 2
        **dict.fromkeys(("dapo", "cispo", "vespo"), 6.0 / (12 / 2 * 2 / 4)),
    }
    assert set(expected) == set(LOSS_TYPES)
    for loss_type, value in expected.items():
        assert aggregate_as_loss_type(per_token, mask, loss_type=loss_type, **common).item() == pytest.approx(value)
    with pytest.raises(ValueError, match="Unknown loss_type 'new'"):
        aggregate_as_loss_type(per_token, mask, loss_type="new", **common)
    with pytest.raises(ValueError, match="num_items_in_batch .* is needed"):
        aggregate_as_loss_type(per_token, mask, loss_type="dapo", accumulation=1.0, max_completion_length=4)
