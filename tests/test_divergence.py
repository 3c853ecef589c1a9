"""The dense term's divergence (`opd_divergence_beta`, TRL's meaning): forward KL, reverse KL and the generalised JSD
between, for 'full' and 'topk', against the sums written out over the vocabulary in float64."""

import math

import pytest
import torch

from trl_opd import OPDTrainer
from trl_opd.heads import OutputHead
from trl_opd.loss import (
    dense_divergence,
    dense_reverse_kl,
    dense_topk_divergence,
    dense_topk_reverse_kl,
)

BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]


def _explicit(student, teacher, beta):
    """The divergence `beta` selects between two log-prob tensors (..., outcomes), written out in float64."""
    student, teacher = student.double(), teacher.double()
    if beta == 1.0:
        return (student.exp() * (student - teacher)).sum(-1)
    if beta == 0.0:
        return (teacher.exp() * (teacher - student)).sum(-1)
    mixture = (beta * teacher.exp() + (1 - beta) * student.exp()).log()
    return (beta * teacher.exp() * (teacher - mixture) + (1 - beta) * student.exp() * (student - mixture)).sum(-1)


def _pair():
    torch.manual_seed(0)
    student_hidden = torch.randn(2, 5, 16, requires_grad=True)
    student_weight = (torch.randn(300, 16) * 0.5).requires_grad_()
    teacher_hidden, teacher_weight = torch.randn(2, 5, 24), torch.randn(300, 24) * 0.5
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    return student_hidden, student_weight, teacher_hidden, teacher_weight, mask


@pytest.mark.parametrize("beta", BETAS)
def test_full_vocabulary_divergence_and_its_gradient_equal_the_explicit_sum(beta):
    student_hidden, student_weight, teacher_hidden, teacher_weight, mask = _pair()
    got = dense_divergence(student_hidden, OutputHead(student_weight), teacher_hidden, OutputHead(teacher_weight), mask,
                           beta=beta)
    student = (student_hidden.double() @ student_weight.double().T).log_softmax(-1)
    teacher = (teacher_hidden.double() @ teacher_weight.double().T).log_softmax(-1)
    want = _explicit(student, teacher, beta) * mask
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)
    assert got[0, 3:].abs().sum() == 0
    grads = torch.autograd.grad(got.sum(), [student_hidden, student_weight])
    expected = torch.autograd.grad(want.sum(), [student_hidden, student_weight])
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-4)
    assert grads[0][0, 3:].abs().sum() == 0  # no gradient where the mask is 0
    same = dense_divergence(student_hidden, OutputHead(student_weight), student_hidden.detach(),
                            OutputHead(student_weight.detach()), mask, beta=beta)
    assert same.abs().max() < 1e-5  # teacher == student: zero for every beta


@pytest.mark.parametrize("beta", BETAS)
def test_topk_divergence_and_its_gradient_equal_the_explicit_bucketed_sum(beta):
    student_hidden, student_weight, teacher_hidden, teacher_weight, mask = _pair()
    k = 7
    teacher_logps_all = (teacher_hidden @ teacher_weight.T).log_softmax(-1)
    logps, ids = teacher_logps_all.topk(k, dim=-1)
    got = dense_topk_divergence(student_hidden, OutputHead(student_weight), ids, logps, mask, beta=beta)

    # the k teacher-top tokens one by one, all others as one bucket, in float64
    student_all = (student_hidden.double() @ student_weight.double().T).log_softmax(-1)
    student_top = student_all.gather(-1, ids)
    bucket = lambda top: torch.cat([top, (1 - top.exp().sum(-1, keepdim=True)).log()], -1)  # noqa: E731
    want = _explicit(bucket(student_top), bucket(logps.double()), beta) * mask
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)
    grads = torch.autograd.grad(got.sum(), [student_hidden, student_weight])
    expected = torch.autograd.grad(want.sum(), [student_hidden, student_weight])
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-4)
    assert grads[0][0, 3:].abs().sum() == 0


def test_beta_one_is_exactly_the_reverse_kl():
    student_hidden, student_weight, teacher_hidden, teacher_weight, mask = _pair()
    heads = OutputHead(student_weight), OutputHead(teacher_weight)
    assert torch.equal(dense_divergence(student_hidden, heads[0], teacher_hidden, heads[1], mask, beta=1.0),
                       dense_reverse_kl(student_hidden, heads[0], teacher_hidden, heads[1], mask))
    logps, ids = (teacher_hidden @ teacher_weight.T).log_softmax(-1).topk(5, dim=-1)
    assert torch.equal(dense_topk_divergence(student_hidden, heads[0], ids, logps, mask, beta=1.0),
                       dense_topk_reverse_kl(student_hidden, heads[0], ids, logps, mask))


def test_a_beta_the_estimator_cannot_honour_is_refused(tiny, prompts, make_config):
    with pytest.raises(ValueError, match=r"opd_divergence_beta=0.5 chooses the dense term's divergence, and "
                                         r"opd_estimator='sampled' has none"):
        OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), train_dataset=prompts,
                   args=make_config(opd_estimator="sampled", opd_divergence_beta=0.5))
    with pytest.raises(ValueError, match=r"opd_divergence_beta must be in \[0, 1\]"):
        make_config(opd_estimator="full", opd_divergence_beta=1.5)


@pytest.mark.parametrize(("estimator", "beta", "metric"), [("full", 0.0, "opd/forward_kl_dense"),
                                                           ("topk", 0.5, "opd/jsd_topk")])
def test_training_logs_the_chosen_divergence_and_it_is_the_loss(tiny, prompts, make_config, estimator, beta, metric):
    trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), train_dataset=prompts,
                         args=make_config(opd_estimator=estimator, opd_divergence_beta=beta, max_steps=1))
    trainer.train()
    logged = next(e for e in trainer.state.log_history if metric in e)
    assert math.isfinite(logged[metric]) and logged[metric] > 0
    assert logged["loss"] == pytest.approx(logged[metric], rel=1e-5)  # the dense term alone is the loss
    assert "opd/reverse_kl_dense" not in logged and "opd/reverse_kl_topk" not in logged


def test_the_preflight_accepts_a_recipe_with_another_divergence(tiny, tmp_path, capsys):
    # its reference pass uses the sampled estimator, which must not inherit the recipe's beta (refused there)
    from pathlib import Path

    from trl_opd.tools import cli

    smoke = str(Path(__file__).parents[1] / "recipes" / "smoke_cpu.yaml")
    argv = ["check", "--config", smoke, "--model_name_or_path", str(tiny / "student"), "--teacher_model_name_or_path",
            str(tiny / "teacher"), "--dataset_name", str(tiny / "train.jsonl"), "--output_dir", str(tmp_path / "x"),
            "--opd_divergence_beta", "0.5"]
    with pytest.raises(SystemExit) as exit_code:
        cli.main(argv)
    out = capsys.readouterr().out
    assert exit_code.value.code == 0 and "opd/jsd_dense" in out
    assert "reference as teacher: opd/reverse_kl = 0.000000 (OK, 0 as expected)" in out
