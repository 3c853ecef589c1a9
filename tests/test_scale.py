"""Batch-layout invariance: how the global batch is split across micro-steps does not change the update."""

import pytest
import torch

from trl_opd import OPDTrainer


def test_global_batch_as_1x8_or_8x1_gives_the_same_loss_and_update(tiny, prompts, make_config):
    def run(per_device, accumulation):
        # SGD: the update is the gradient itself (Adam's first step divides by |g| and amplifies float noise)
        config = make_config(max_steps=1, per_device_train_batch_size=per_device, optim="sgd",
                             gradient_accumulation_steps=accumulation, learning_rate=1.0, teacher_batch_size=8)
        trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=config,
                             train_dataset=prompts)
        trainer.train()
        return trainer, next(entry for entry in trainer.state.log_history if "loss" in entry)

    (one_by_eight, log_a), (eight_by_one, log_b) = run(8, 1), run(1, 8)
    assert log_a["opd/reverse_kl"] == pytest.approx(log_b["opd/reverse_kl"], rel=1e-6, abs=1e-7)  # same 8 samples
    assert log_a["loss"] == pytest.approx(log_b["loss"], rel=1e-5)
    assert log_a["grad_norm"] == pytest.approx(log_b["grad_norm"], rel=1e-4)
    for (name, a), b in zip(one_by_eight.model.named_parameters(), eight_by_one.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    initial = _student(tiny).parameters()
    assert all(not torch.equal(a, b) for a, b in zip(one_by_eight.model.parameters(), initial, strict=True))


def _student(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny / "student")
