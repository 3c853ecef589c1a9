"""On-policy, the teacher's advantage is formed in the student's loss forward (`advantages.py`): one student forward
a step, and the values the separate no-grad forward of the sampling policy gave."""

from dataclasses import replace

import pytest
import torch

from trl_opd import OPDTrainer

# Logged values that measure the machine, not the training
_TIMING = ("step_time", "data/completion_tokens_per_second", "epoch")


def _digits_reward(completions, **kwargs):
    """A deterministic reward that varies between completions: the fraction of digits in the text."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def _observed_rollout(prompts, trainer):
    """A rollout function's path: the student's turn, then an observation appended by code, masked 0."""
    tokenizer = trainer.processing_class
    model = trainer.accelerator.unwrap_model(trainer.model)
    observation = tokenizer.encode("\n<|im_start|>user\nObservation: 7<|im_end|>\n")
    result = {"prompt_ids": [], "completion_ids": [], "logprobs": None, "action_mask": []}
    for prompt in prompts:
        prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), do_sample=True, max_new_tokens=6,
                                 pad_token_id=tokenizer.pad_token_id)
        sampled = out[0, len(prompt_ids):].tolist()
        result["prompt_ids"].append(prompt_ids)
        result["completion_ids"].append(sampled + observation)
        result["action_mask"].append([1] * len(sampled) + [0] * len(observation))
    return result


def _train_one_step(tiny, prompts, make_config, *, separate_forward, rewards=False, rollout=False, fused_head=False,
                    **overrides):
    """One optimizer step; with `separate_forward`, the advantage is formed at generation from a no-grad forward of
    the sampling policy, the path every batch took before; with `fused_head`, the loss forward's log-probs come from
    GRPO's fused head over every position. Returns the trainer and the student's forwards outside generation."""
    config = make_config(max_steps=1, num_generations=2 if rewards else 1,
                         max_completion_length=32 if rollout else 8, **overrides)
    trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=config,
                         train_dataset=prompts, reward_funcs=[_digits_reward] if rewards else None,
                         rollout_func=_observed_rollout if rollout else None)
    if separate_forward:
        trainer.plan = replace(trainer.plan, advantages_in_loss_forward=False)
    if fused_head:
        trainer.plan = replace(trainer.plan, compact_logps=False)
    forwards, generating = [], []
    generate = trainer._generate

    def generating_batch(*args, **kwargs):
        generating.append(True)
        try:
            return generate(*args, **kwargs)
        finally:
            generating.pop()

    trainer._generate = generating_batch
    trainer.model.base_model.register_forward_pre_hook(lambda *_: None if generating else forwards.append(1))
    trainer.train()
    return trainer, len(forwards)


CASES = {
    "teacher alone": {},
    "discounted": {"kl_discount_factor": 0.9},
    "rewards, two objectives": {"rewards": True, "opd_reward_combination": "loss"},
    "rewards, summed advantages": {"rewards": True, "opd_reward_combination": "advantage"},
    "action mask": {"rollout": True},
    "accumulated": {"gradient_accumulation_steps": 2},  # two micro-batches of one generation batch
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_advantage_from_the_loss_forward_equals_a_separate_forward_s(tiny, prompts, make_config, case):
    options = CASES[case]
    micro_batches = options.get("gradient_accumulation_steps", 1)
    new, new_forwards = _train_one_step(tiny, prompts, make_config, separate_forward=False, **options)
    old, old_forwards = _train_one_step(tiny, prompts, make_config, separate_forward=True, **options)
    assert new_forwards == micro_batches  # the loss forward alone
    assert old_forwards == 2 * micro_batches  # and before it, the sampling policy's no-grad forward

    a, b = new.state.log_history[0], old.state.log_history[0]
    assert set(a) == set(b)
    assert {"loss", "grad_norm", "opd/reverse_kl", "opd/advantage_mean", "opd/student_logp"} <= set(a)
    for name in sorted(set(a) - set(_TIMING)):
        assert a[name] == pytest.approx(b[name], rel=1e-5, abs=1e-6), name
    # the completions table shows each row's own mean advantage, as before
    assert list(new._logs["advantages"]) == pytest.approx(list(old._logs["advantages"]), rel=1e-5, abs=1e-6)
    assert any(abs(value) > 1e-3 for value in new._logs["advantages"])


def test_an_advantage_the_loss_forward_did_not_form_cannot_train(tiny, prompts, make_config):
    # the batch holds NaN where the advantages go until the loss forward forms them: a loss computed without them
    # stops the run at that step rather than logging a healthy-looking loss
    trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), train_dataset=prompts,
                         args=make_config(max_steps=1))
    batch = trainer._generate_and_score_completions([dict(prompts[i]) for i in range(4)])
    assert torch.isnan(batch["advantages"]).all()
    trainer._form_advantages = lambda inputs, old_per_token_logps: None  # the fault: the loss forms nothing
    with pytest.raises(FloatingPointError, match="not finite"):
        trainer.train()


def test_where_grpo_computes_old_log_probs_the_advantage_is_formed_at_generation(tiny, prompts, make_config):
    # two passes over each batch: the second is off-policy, so the sampling policy's log-probs are GRPO's own
    trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), train_dataset=prompts,
                         args=make_config(max_steps=1, num_iterations=2))
    batch = trainer._generate_and_score_completions([dict(prompts[i]) for i in range(4)])
    assert "teacher_per_token_logps" not in batch
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].size(1)
    with torch.no_grad():
        logits = trainer.teacher_model(input_ids=ids, attention_mask=attention).logits[:, -width - 1 : -1]
    teacher = logits.log_softmax(-1).gather(-1, batch["completion_ids"][..., None]).squeeze(-1)
    expected = (teacher - batch["old_per_token_logps"]) * batch["action_mask"]
    torch.testing.assert_close(batch["advantages"], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["teacher alone", "rewards, two objectives", "action mask"])
def test_the_completion_only_projection_gives_grpo_s_log_probs_and_gradient(tiny, prompts, make_config, case):
    # on a CPU, GRPO's fused head projects prompt positions too; the student's log-probs projected at the completion
    # only (`student.py`) give the same loss, gradient norm, entropy and metrics
    options = CASES[case]
    compact, _ = _train_one_step(tiny, prompts, make_config, separate_forward=False, **options)
    fused, _ = _train_one_step(tiny, prompts, make_config, separate_forward=False, fused_head=True, **options)
    a, b = compact.state.log_history[0], fused.state.log_history[0]
    assert set(a) == set(b)
    for name in sorted(set(a) - set(_TIMING)):
        assert a[name] == pytest.approx(b[name], rel=1e-5, abs=1e-6), name
