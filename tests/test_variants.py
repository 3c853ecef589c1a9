"""Teacher variants (reference, adapter, teacher-only prompt, temperature) and RL + OPD mixing; the student as its own
teacher is in test_self_distillation.py."""

import json
import math

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig

from trl_opd import OPDTrainer


def _first(trainer, key="opd/reverse_kl"):
    return next(entry for entry in trainer.state.log_history if key in entry)


def _lora():
    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")


# ------------------------------------------------------------------------------------------ reference as teacher


@pytest.mark.parametrize("use_peft, beta", [(False, 0.0), (True, 0.0), (False, 0.04)], ids=["full", "lora", "beta"])
def test_reference_as_teacher_gives_zero_kl_at_the_first_step(tiny, prompts, make_config, use_peft, beta):
    config = make_config(max_steps=2, ref_as_teacher=True, beta=beta, learning_rate=1e-2)
    trainer = OPDTrainer(
        model=str(tiny / "student"), args=config, train_dataset=prompts, peft_config=_lora() if use_peft else None
    )
    assert trainer.teacher_model is None  # no second model beyond GRPO's own reference
    assert (trainer.ref_model is None) == use_peft  # a PEFT student's reference is its adapter-disabled self
    assert trainer.beta == beta  # no KL penalty was added for the teacher's sake
    trainer.train()
    first = _first(trainer)
    assert first["opd/reverse_kl"] == pytest.approx(0.0, abs=1e-5)
    assert first["opd/teacher_logp"] == pytest.approx(first["opd/student_logp"], abs=1e-5)
    assert ("kl" in first) == (beta != 0.0)
    _assert_teacher_stays_frozen_when_the_student_moves(trainer)


def _assert_teacher_stays_frozen_when_the_student_moves(trainer):
    ids = torch.tensor([[1, 263, 264, 201, 272, 260, 291, 287]])
    mask = torch.ones_like(ids)
    before = trainer.teacher.score(ids[:, :4], mask[:, :4], ids[:, 4:], mask[:, 4:]).logps
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn_like(parameter) * 0.5)
    after = trainer.teacher.score(ids[:, :4], mask[:, :4], ids[:, 4:], mask[:, 4:]).logps
    student = trainer._student_logps(ids[:, :4], mask[:, :4], ids[:, 4:], mask[:, 4:])
    torch.testing.assert_close(after, before)
    assert (student - before).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------- adapter teacher


@pytest.fixture(scope="module")
def teacher_adapter(tiny, tmp_path_factory):
    """A LoRA adapter on the tiny student, with random (non-zero) weights: a 'domain expert' of the student's base."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny / "student"), _lora())
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("adapter") / "expert"
    model.save_pretrained(path)
    return path


def test_adapter_teacher_scores_like_the_merged_expert(tiny, prompts, make_config, teacher_adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = make_config(teacher_model_name_or_path=str(tiny / "student"),
                         teacher_adapter_name_or_path=str(teacher_adapter))
    trainer = OPDTrainer(model=str(tiny / "student"), args=config, train_dataset=prompts)
    expert = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny / "student"), teacher_adapter)
    ids = torch.tensor([[1, 263, 264, 201, 272, 260, 291, 287]])
    mask = torch.ones_like(ids)
    scores = trainer.teacher.score(ids[:, :4], mask[:, :4], ids[:, 4:], mask[:, 4:])
    with torch.no_grad():
        expected = expert(ids).logits.log_softmax(-1)[0, 3:-1].gather(-1, ids[0, 4:, None])[:, 0]
    torch.testing.assert_close(scores.logps[0], expected, atol=1e-5, rtol=1e-5)
    trainer.train()
    assert _first(trainer)["opd/reverse_kl"] > 1e-3  # the expert differs from the plain student


def test_adapter_teacher_errors(tiny, prompts, make_config, teacher_adapter, tmp_path):
    missing = make_config(teacher_model_name_or_path=str(tiny / "student"),
                          teacher_adapter_name_or_path=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"teacher_adapter_name_or_path '.*nowhere' does not exist"):
        OPDTrainer(model=str(tiny / "student"), args=missing, train_dataset=prompts)
    (tmp_path / "empty").mkdir()
    not_an_adapter = make_config(teacher_model_name_or_path=str(tiny / "student"),
                                 teacher_adapter_name_or_path=str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="has no adapter_config.json"):
        OPDTrainer(model=str(tiny / "student"), args=not_an_adapter, train_dataset=prompts)
    other_base = make_config(teacher_model_name_or_path=str(tiny / "teacher"),
                             teacher_adapter_name_or_path=str(teacher_adapter))
    with pytest.raises(ValueError, match=r"was trained on .*student.* but the teacher base model is .*teacher"):
        OPDTrainer(model=str(tiny / "student"), args=other_base, train_dataset=prompts)


# ------------------------------------------------------------------------------------ teacher-only prompt


class _Recorder:
    """Wraps the real scorer and records what it was asked to score (a spy, not a fake: scores are real)."""

    def __init__(self, scorer):
        self.scorer, self.calls = scorer, []

    def score(self, *args):
        self.calls.append([a.clone() for a in args])
        return self.scorer.score(*args)


def test_teacher_system_prompt_changes_only_the_teachers_context(tiny, tokenizer, prompts, make_config):
    def run(**overrides):
        trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "student"),
                             args=make_config(max_steps=1, **overrides), train_dataset=prompts)
        trainer.teacher = _Recorder(trainer.teacher)
        trainer.train()
        return trainer

    plain, privileged = run(), run(teacher_system_prompt="Answer with the number only.")
    prompt_ids, prompt_mask, completion_ids, _ = privileged.teacher.calls[0]
    text = tokenizer.decode(prompt_ids[0][prompt_mask[0].bool()])
    assert text.startswith("<|im_start|>system\nAnswer with the number only.<|im_end|>\n<|im_start|>user\nWhat is")
    assert torch.equal(completion_ids, plain.teacher.calls[0][2])  # identical completion tokens, same seed
    assert _first(plain)["opd/reverse_kl"] == pytest.approx(0.0, abs=1e-5)  # teacher == student, same context
    assert abs(_first(privileged)["opd/reverse_kl"]) > 1e-3  # same model, other context: a real signal


def test_teacher_prompt_column(tiny, tokenizer, make_config):
    rows = [json.loads(line) for line in open(tiny / "train.jsonl")][:8]
    dataset = Dataset.from_list(
        [{"prompt": row["prompt"], "teacher_prompt": [{"role": "user", "content": f"Hint: {row['answer']}"}]}
         for row in rows]
    )
    trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"),
                         args=make_config(max_steps=1, teacher_prompt_column="teacher_prompt"), train_dataset=dataset)
    trainer.teacher = _Recorder(trainer.teacher)
    trainer.train()
    prompt_ids, prompt_mask, _, _ = trainer.teacher.calls[0]
    assert "Hint:" in tokenizer.decode(prompt_ids[0][prompt_mask[0].bool()])
    with pytest.raises(ValueError, match="no 'teacher_prompt' column"):
        OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"),
                   args=make_config(teacher_prompt_column="teacher_prompt"), train_dataset=Dataset.from_list(rows))


def test_teacher_prompt_template_fills_the_last_user_message_from_the_row(tiny, tokenizer, make_config):
    # self-distillation with the reference answer as privileged context: the template over each row's columns
    rows = [json.loads(line) for line in open(tiny / "train.jsonl")][:8]
    dataset = Dataset.from_list([{"prompt": [{"role": "system", "content": "Be brief."}, *row["prompt"]],
                                  "answer": row["answer"]} for row in rows])
    template = "{prompt}\n\nA worked answer: {answer}"
    trainer = OPDTrainer(model=str(tiny / "student"), train_dataset=dataset, args=make_config(
        max_steps=1, student_as_teacher="live", teacher_prompt_template=template))
    trainer.teacher = _Recorder(trainer.teacher)
    trainer.train()
    prompt_ids, prompt_mask, _, _ = trainer.teacher.calls[0]
    seen = {tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(prompt_ids, prompt_mask, strict=True)}
    expected = {tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": f"{row['prompt'][0]['content']}\n\nA worked answer: {row['answer']}"}],
        add_generation_prompt=True, tokenize=False) for row in rows}
    # each row's: the system message kept, the user message filled, the teacher's chat template around them
    assert len(seen) == len(prompt_ids) and seen <= expected
    assert _first(trainer)["opd/reverse_kl"] > 1e-3  # the live student with the answer in view: a real signal

    from trl_opd.prompts import teacher_prompt
    assert teacher_prompt({"prompt": "2 + 2?", "answer": "4"}, "2 + 2?", template=template) == (
        "2 + 2?\n\nA worked answer: 4")  # a text prompt is filled whole



def test_the_reference_teacher_reads_the_template_instead_of_reusing_grpos_logps(tiny, prompts, make_config):
    # with its own prompt the reference teacher cannot reuse GRPO's reference log-probs (computed with beta > 0, over
    # the student's prompt)
    trainer = OPDTrainer(model=str(tiny / "student"), train_dataset=prompts, args=make_config(
        max_steps=1, ref_as_teacher=True, beta=0.04, teacher_prompt_template="{prompt}\n\nA worked answer: {answer}"))
    trainer.train()
    assert abs(_first(trainer)["opd/reverse_kl"]) > 1e-3  # 0 if the student's prompt were scored

@pytest.mark.parametrize(("options", "message"), [
    (dict(teacher_prompt_template="{prompt} {reference}"), "no 'reference' column .* teacher_prompt_template"),
    (dict(teacher_prompt_template="{prompt} {0}"), "must name the row's columns as {column}"),
    (dict(teacher_prompt_template="{prompt} {answer"), "is not a template"),
    (dict(teacher_prompt_template="{prompt} {answer}", teacher_prompt_column="answer"), "not both"),
])
def test_a_template_that_cannot_be_filled_is_refused_before_training(tiny, prompts, make_config, options, message):
    with pytest.raises(ValueError, match=message):
        OPDTrainer(model=str(tiny / "student"), train_dataset=prompts,
                   args=make_config(student_as_teacher="live", **options))


def test_a_row_without_the_templates_column_is_refused_naming_it(tiny, prompts, make_config):
    rows = prompts.to_list()
    rows[3]["answer"] = None
    with pytest.raises(ValueError, match="train_dataset row 3 has no 'answer'"):
        OPDTrainer(model=str(tiny / "student"), train_dataset=Dataset.from_list(rows),
                   args=make_config(student_as_teacher="live", teacher_prompt_template="{prompt} {answer}"))


# -------------------------------------------------------------------------------------------- temperature


def test_teacher_temperature_divides_the_teachers_logits(tiny):
    from transformers import AutoModelForCausalLM

    from trl_opd.teachers import LocalTeacher
    from trl_opd.teachers.local import freeze_teacher

    ids = torch.tensor([[1, 263, 264, 201, 272, 260, 291, 287]])
    mask = torch.ones_like(ids)
    model = AutoModelForCausalLM.from_pretrained(tiny / "teacher")
    with torch.no_grad():
        expected = (model(ids).logits / 2.0).log_softmax(-1)[0, 3:-1].gather(-1, ids[0, 4:, None])[:, 0]
    scores = LocalTeacher(freeze_teacher(model), batch_size=1, temperature=2.0).score(
        ids[:, :4], mask[:, :4], ids[:, 4:], mask[:, 4:]
    )
    torch.testing.assert_close(scores.logps[0], expected, atol=1e-5, rtol=1e-5)


def test_teacher_temperature_is_refused_where_it_cannot_apply(teacher_server, make_config):
    # a log-prob server cannot renormalise; one that returns hidden states can (tests/test_served_hidden.py)
    from trl_opd.teachers.loading import connect_served_teacher

    with pytest.raises(ValueError, match="a vLLM log-prob server returns raw log-probs and cannot renormalise"):
        connect_served_teacher([teacher_server], make_config(teacher_temperature=0.5), student_tokenizer=None,
                               student_name="s")


# ------------------------------------------------------------------------------------------------ RL + OPD


def _digits_reward(completions, **kwargs):
    """A deterministic reward: the fraction of digits in the completion text."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def _constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


def _mixed(tiny, prompts, make_config, reward, **overrides):
    config = make_config(max_steps=1, num_generations=2, per_device_train_batch_size=4, **overrides)
    trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=config,
                         train_dataset=prompts, reward_funcs=[reward] if reward else None)
    trainer.train()
    return _first(trainer, "loss")


@pytest.mark.parametrize("estimator", ["sampled", "topk", "full"])
def test_reward_only_reproduces_grpo(tiny, prompts, make_config, estimator):
    # opd_loss_coef 0 switches the whole teacher signal off, dense term included (old main added the dense term)
    from trl import GRPOConfig, GRPOTrainer

    opd = _mixed(tiny, prompts, make_config, _digits_reward, opd_loss_coef=0.0, opd_estimator=estimator)
    fields = {k: v for k, v in make_config(max_steps=1, num_generations=2).to_dict().items()
              if k in GRPOConfig.__dataclass_fields__ and GRPOConfig.__dataclass_fields__[k].init}
    fields.update(max_steps=1, num_generations=2, per_device_train_batch_size=4)
    fields = {k: v for k, v in fields.items() if not k.startswith("_") and k not in ("generation_batch_size",
                                                                                      "steps_per_generation")}
    grpo = GRPOTrainer(model=str(tiny / "student"), reward_funcs=[_digits_reward], args=GRPOConfig(**fields),
                       train_dataset=prompts)
    grpo.train()
    reference = _first(grpo, "loss")
    assert opd["reward"] == pytest.approx(reference["reward"])  # same samples, same rewards
    assert opd["loss"] == pytest.approx(reference["loss"], abs=1e-5)
    assert opd["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("combination", ["loss", "advantage"])
def test_teacher_only_reproduces_core_opd(tiny, prompts, make_config, combination):
    # a constant reward has zero group-normalised advantage: only the teacher term is left
    core = _mixed(tiny, prompts, make_config, None)
    mixed = _mixed(tiny, prompts, make_config, _constant_reward, opd_reward_combination=combination)
    assert mixed["loss"] == pytest.approx(core["loss"], rel=1e-5, abs=1e-6)
    assert mixed["opd/reverse_kl"] == pytest.approx(core["opd/reverse_kl"], rel=1e-6, abs=1e-7)


def test_both_parts_are_logged_and_the_two_combinations_differ_once_clipping_acts(tiny, prompts, make_config):
    # a second pass over the same batch (num_iterations=2) sees ratios != 1, where clipping makes the two differ
    def run(combination):
        config = make_config(max_steps=2, num_generations=2, num_iterations=2, epsilon=0.02, learning_rate=5e-2,
                             opd_loss_coef=0.5, opd_reward_combination=combination)
        trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=config,
                             train_dataset=prompts, reward_funcs=[_digits_reward])
        trainer.train()
        return [entry for entry in trainer.state.log_history if "loss" in entry and "learning_rate" in entry]

    summed_losses, summed_advantages = run("loss"), run("advantage")
    for entry in summed_losses:
        assert entry["loss"] == pytest.approx(entry["rl/loss"] + 0.5 * entry["opd/loss"], abs=1e-5)
    expected_metrics = {"reward", "reward_std", "rewards/_digits_reward/mean", "opd/clip_ratio/region_mean"}
    assert expected_metrics <= set(summed_losses[0])
    assert "rl/loss" not in summed_advantages[0]
    # on-policy (ratio 1) the clipped objective is linear in the advantage: both agree; clipped, they do not
    assert summed_advantages[0]["loss"] == pytest.approx(summed_losses[0]["loss"], abs=1e-5)
    assert summed_losses[1]["opd/clip_ratio/region_mean"] > 0
    assert abs(summed_advantages[1]["loss"] - summed_losses[1]["loss"]) > 1e-4


def test_rewards_need_groups(tiny, prompts, make_config):
    with pytest.raises(ValueError, match="num_generations >= 2"):
        OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=make_config(),
                   train_dataset=prompts, reward_funcs=[_digits_reward])


# ------------------------------------------------------------------------------------------ multi-teacher routing


def _routed_prompts(tiny, routes):
    rows = [json.loads(line) for line in open(tiny / "train.jsonl")][: len(routes)]
    return Dataset.from_list([{"prompt": r["prompt"], "teacher": t} for r, t in zip(rows, routes, strict=True)])


def test_each_row_is_scored_by_the_teacher_it_names(tiny, make_config):
    teachers = {"expert": str(tiny / "teacher"), "self": str(tiny / "student")}
    dataset = _routed_prompts(tiny, ["expert", "self"] * 4)
    trainer = OPDTrainer(model=str(tiny / "student"), args=make_config(max_steps=1, teachers=teachers),
                         train_dataset=dataset)
    assert set(trainer.teacher_models) == {"expert", "self"}
    scorers = trainer.teacher.scorers
    ids = torch.tensor([[1, 263, 264, 201, 272, 260, 291, 287]] * 2)
    mask = torch.ones_like(ids)
    batch = (ids[:, :4], mask[:, :4], ids[:, 4:], mask[:, 4:])
    routed = trainer.teacher.score(*batch, routes=["self", "expert"])
    torch.testing.assert_close(routed.logps[0], scorers["self"].score(*batch).logps[0])
    torch.testing.assert_close(routed.logps[1], scorers["expert"].score(*batch).logps[1])
    assert not torch.allclose(routed.logps[0], routed.logps[1])

    trainer.train()
    assert math.isfinite(_first(trainer)["opd/reverse_kl"]) and "opd/teacher_entropy" in _first(trainer)
    # only the "self" rows: teacher == student, so their KL is 0 and the batch KL is the experts' alone
    self_only = OPDTrainer(model=str(tiny / "student"), args=make_config(max_steps=1, teachers=teachers),
                           train_dataset=_routed_prompts(tiny, ["self"] * 8))
    self_only.train()
    assert _first(self_only)["opd/reverse_kl"] == pytest.approx(0.0, abs=1e-5)


def test_routing_errors_before_training(tiny, prompts, make_config):
    teachers = {"expert": str(tiny / "teacher")}
    with pytest.raises(ValueError, match=r"no 'teacher' column .* to route rows to teachers \['expert'\]"):
        OPDTrainer(model=str(tiny / "student"), args=make_config(teachers=teachers), train_dataset=prompts)
    with pytest.raises(ValueError, match=r"routes rows to \['chemistry'\], which are not among .*\['expert'\]"):
        OPDTrainer(model=str(tiny / "student"), args=make_config(teachers=teachers),
                   train_dataset=_routed_prompts(tiny, ["expert", "chemistry"]))


def test_the_reward_term_keeps_grpos_clipping_when_the_teacher_term_is_unclipped(tiny, prompts, make_config):
    # ratio 2 on every token, A_RL = A_teacher = 1, epsilon 0.2 / epsilon_high 0.28: the RL loss is GRPO's clipped
    # -min(2, 1.28) = -1.28, the teacher's unclipped -2 (old main unclipped both: rl/loss -2)
    config = make_config(num_generations=2, opd_objective="importance_sampling", loss_type="dapo", epsilon=0.2,
                         epsilon_high=0.28, opd_loss_coef=0.5)
    trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=config,
                         train_dataset=prompts, reward_funcs=[_digits_reward])
    model = trainer.model
    model.eval()  # no accumulation scaling
    prompt_ids, completion_ids = torch.tensor([[1, 263, 264, 201]]), torch.tensor([[272, 260, 291]])
    prompt_mask, completion_mask = torch.ones_like(prompt_ids), torch.ones_like(completion_ids)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), 3
        )
    inputs = {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
        "completion_mask": completion_mask, "action_mask": completion_mask, "old_per_token_logps": logps - math.log(2),
        "advantages": torch.ones(1, 3), "teacher_advantages": torch.ones(1, 3), "num_items_in_batch": torch.tensor(3.0),
    }
    loss = trainer.compute_loss(model, inputs)
    assert trainer._metrics["eval"]["rl/loss"][-1] == pytest.approx(-1.28, abs=1e-5)
    assert trainer._metrics["eval"]["opd/loss"][-1] == pytest.approx(-2.0, abs=1e-5)
    assert loss.item() == pytest.approx(-1.28 + 0.5 * -2.0, abs=1e-5)
    assert (trainer.epsilon_low, trainer.epsilon_high) == (0.2, 0.28)  # restored after the teacher's objective


def test_rl_and_opd_losses_are_on_the_scale_of_the_logged_loss(tiny, prompts, make_config):
    # both are divided for gradient accumulation inside GRPO's loss; logged undivided, they add up to `loss`
    # (old main: at gradient_accumulation_steps=2, rl/loss + opd/loss was half of loss)
    config = make_config(max_steps=2, num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         opd_loss_coef=0.5)
    trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=config,
                         train_dataset=prompts, reward_funcs=[_digits_reward])
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "rl/loss" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert entry["loss"] == pytest.approx(entry["rl/loss"] + 0.5 * entry["opd/loss"], abs=1e-4)


def test_ref_as_teacher_with_a_kl_penalty_keeps_the_teacher_only_prompt(tiny, prompts, make_config):
    # GRPO's reference log-probs (for beta > 0) are on the student's prompt: the teacher's own prompt must be scored
    # instead (old main reused them, a KL of exactly 0 and nothing learned)
    def first_kl(beta):
        trainer = OPDTrainer(model=str(tiny / "student"), train_dataset=prompts,
                             args=make_config(max_steps=1, ref_as_teacher=True, beta=beta,
                                              teacher_system_prompt="Answer with one number."))
        trainer.train()
        return _first(trainer)["opd/reverse_kl"]

    without_penalty = first_kl(0.0)
    assert abs(without_penalty) > 1e-3
    assert first_kl(0.04) == pytest.approx(without_penalty, rel=1e-5)


OPTIONS_THAT_DO_NOTHING = {
    "importance_sampling with the dense term alone": (dict(opd_estimator="full", opd_objective="importance_sampling"),
                                                      "shapes the sampled-token term"),
    "discount with the dense term alone": (dict(opd_estimator="topk", kl_discount_factor=0.9),
                                           "shapes the sampled-token term"),
    "opd_loss_coef without rewards": (dict(opd_loss_coef=0.5), "there are none"),
    "no signal at all": (dict(opd_estimator="sampled", opd_coef=0.0), "Nothing to learn from"),
    "no dense weight": (dict(opd_estimator="full", opd_dense_coef=0.0), "Nothing to learn from"),
    # GRPO's own options that shape its policy-gradient term: with the dense term alone every advantage is 0
    "entropy mask with the dense term alone": (dict(opd_estimator="full", top_entropy_quantile=0.2),
                                               "top_entropy_quantile=0.2 shapes GRPO's policy-gradient term"),
    "off-policy mask with the dense term alone": (dict(opd_estimator="topk", off_policy_mask_threshold=0.5),
                                                  "off_policy_mask_threshold=0.5 shapes GRPO's policy-gradient"),
    "two-sided clip with the dense term alone": (dict(opd_estimator="full", delta=2.0), "delta=2.0 shapes GRPO's"),
    "sequence-level ratio with the dense term alone": (dict(opd_estimator="full", importance_sampling_level="sequence"),
                                                       "importance_sampling_level='sequence' shapes GRPO's"),
    "reward combination without rewards": (dict(opd_reward_combination="advantage"), "and there are none"),
    "route column without routed teachers": (dict(teacher_route_column="route"), "none are set"),
}


@pytest.mark.parametrize("overrides, message", OPTIONS_THAT_DO_NOTHING.values(), ids=OPTIONS_THAT_DO_NOTHING.keys())
def test_an_option_the_configuration_would_ignore_is_refused(tiny, prompts, make_config, overrides, message):
    with pytest.raises(ValueError, match=message):
        OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), train_dataset=prompts,
                   args=make_config(**overrides))


def test_grpo_s_policy_options_are_taken_where_the_sampled_term_gives_them_advantages(tiny, prompts, make_config):
    # the refusals above are for the dense term alone: beside the sampled-token term the options shape that term
    for options in (dict(top_entropy_quantile=0.2), dict(off_policy_mask_threshold=0.5), dict(delta=2.0)):
        trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), train_dataset=prompts,
                             args=make_config(opd_estimator="full", opd_coef=1.0, **options))
        assert all(getattr(trainer.args, name) == value for name, value in options.items())


def test_a_reference_teacher_that_follows_the_student_is_refused(tiny, prompts, make_config):
    # sync_ref_model pulls GRPO's reference copy, which ref_as_teacher reads, towards the student (old main let it:
    # the teacher drifted into the student)
    with pytest.raises(ValueError, match="ref_as_teacher reads that reference as the teacher"):
        OPDTrainer(model=str(tiny / "student"), train_dataset=prompts,
                   args=make_config(ref_as_teacher=True, sync_ref_model=True, beta=0.04,
                                    teacher_system_prompt="Answer with one number."))


def test_the_reference_teacher_scores_in_forwards_of_teacher_batch_size(tiny, prompts, make_config):
    trainer = OPDTrainer(model=str(tiny / "student"), train_dataset=prompts,
                         args=make_config(max_steps=1, ref_as_teacher=True, teacher_batch_size=1,
                                          teacher_system_prompt="Answer with one number."))
    sizes, original = [], trainer._get_per_token_logps_and_entropies

    def recorded(model, input_ids, *args, batch_size=None, **kwargs):
        sizes.append((len(input_ids), batch_size))
        return original(model, input_ids, *args, batch_size=batch_size, **kwargs)

    trainer._get_per_token_logps_and_entropies = recorded
    trainer.train()
    assert (4, 1) in sizes  # the teacher's pass: 4 sequences, 1 a forward (old main: 4, the training batch size)


def test_importance_sampling_with_summed_advantages_is_refused(tiny, prompts, make_config):
    with pytest.raises(ValueError, match="opd_reward_combination='loss'"):
        OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), train_dataset=prompts,
                   reward_funcs=[_digits_reward],
                   args=make_config(num_generations=2, opd_reward_combination="advantage",
                                    opd_objective="importance_sampling"))
