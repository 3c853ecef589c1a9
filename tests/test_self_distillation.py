"""The student as its own teacher (`student_as_teacher`: initial, live or ema weights), with privileged context only
the teacher reads: what each kind scores with, the moving average by hand, checkpoints, and what is refused."""

from pathlib import Path

import pytest
import torch
from peft import LoraConfig

from trl_opd import OPDConfig, OPDTrainer
from trl_opd.teachers.local import LocalTeacher, freeze_teacher

HINT = "Answer with the number only."


def _lora():
    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")


def _trainer(tiny, prompts, make_config, *, peft: bool, **overrides):
    config = make_config(**{"teacher_system_prompt": HINT, **overrides})
    return OPDTrainer(model=str(tiny / "student"), args=config, train_dataset=prompts,
                      peft_config=_lora() if peft else None)


def _first(trainer, key="opd/reverse_kl"):
    return next(entry for entry in trainer.state.log_history if key in entry)


def _batch(tokenizer, *, system: str | None):
    """A prompt as the student (no system message) or the teacher (the hint) reads it, and a fixed completion."""
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    if system:
        messages = [{"role": "system", "content": system}, *messages]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    completion = torch.tensor([tokenizer("The answer is 42.", add_special_tokens=False)["input_ids"]])
    return prompt, torch.ones_like(prompt), completion, torch.ones_like(completion)


def _perturb(model):
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn_like(parameter) * 0.3)


def _scored_by(model, batch, temperature=1.0):
    """Log-probs of the completion under `model` (a fresh, frozen scorer of it), to compare with a kind's teacher."""
    return LocalTeacher(freeze_teacher(model), batch_size=4, temperature=temperature).score(*batch).logps


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_live_teacher_scores_are_the_students_own_no_grad_logps_with_the_teachers_context(
        tiny, prompts, tokenizer, make_config, peft):
    trainer = _trainer(tiny, prompts, make_config, peft=peft, student_as_teacher="live", temperature=0.7)
    assert trainer.ref_model is None and trainer.teacher_model is None  # no second copy of the weights
    _perturb(trainer.model)  # the live teacher follows the student wherever it is
    prompt, prompt_mask, completion, completion_mask = _batch(tokenizer, system=HINT)
    scores = trainer.teacher.score(prompt, prompt_mask, completion, completion_mask).logps
    student = trainer._no_grad_logps(trainer.model, torch.cat([prompt, completion], 1),
                                     torch.cat([prompt_mask, completion_mask], 1), completion.size(1))
    # two computations of log-probs up to ~16 in magnitude: float32 round-off there is ~2e-6 (measured 1.9e-6 on an
    # AMD EPYC), so the tolerance scales with the values (1e-6 of the largest, about 8 units in the last place)
    torch.testing.assert_close(scores, student, rtol=1e-6, atol=1e-6 * student.abs().max().item())
    without_hint = trainer.teacher.score(*_batch(tokenizer, system=None)).logps
    assert (without_hint - scores).abs().max() > 1e-3  # the context is what differs
    assert all(p.requires_grad for n, p in trainer.model.named_parameters() if "lora_" in n or not peft)


def test_initial_kind_with_full_fine_tuning_keeps_scoring_with_the_starting_weights(
        tiny, prompts, tokenizer, make_config):
    from transformers import AutoModelForCausalLM

    trainer = _trainer(tiny, prompts, make_config, peft=False, student_as_teacher="initial", learning_rate=5e-2,
                       max_steps=3)
    trainer.train()
    batch = _batch(tokenizer, system=HINT)
    start = AutoModelForCausalLM.from_pretrained(tiny / "student", dtype=torch.float32)
    expected = _scored_by(start, batch)
    torch.testing.assert_close(trainer.teacher.score(*batch).logps, expected, rtol=1e-6,
                               atol=1e-6 * expected.abs().max().item())
    moved = _scored_by(trainer.model, batch)
    assert (moved - _scored_by(start, batch)).abs().max() > 1e-2  # while the student itself has moved
    assert trainer.beta == 0.0  # GRPO built the frozen copy; no KL penalty was added for it


class _Recorder:
    """The student's trainable weights after every optimizer step, by name."""

    def __init__(self):
        self.steps = []

    def callback(self, trainer):
        from transformers import TrainerCallback

        recorder = self

        class Record(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                recorder.steps.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()
                                       if p.requires_grad})

        return Record()


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_ema_teacher_after_k_steps_equals_the_average_by_hand(tiny, prompts, make_config, peft):
    rate, every, steps = 0.3, 2, 5
    trainer = _trainer(tiny, prompts, make_config, peft=peft, student_as_teacher="ema", teacher_ema_rate=rate,
                       teacher_ema_steps=every, max_steps=steps, learning_rate=5e-2)
    recorder = _Recorder()
    trainer.callback_handler.callbacks.insert(0, recorder.callback(trainer))  # before the average's own callback
    pairs = trainer.teacher_ema.pairs()
    student_name = {id(student): name for name, student in trainer.model.named_parameters()}
    expected = {name: student.detach().clone() for name, (_, student) in pairs.items()}  # the start: a copy
    trainer.train()
    assert len(recorder.steps) == steps
    for step, weights in enumerate(recorder.steps, start=1):
        if step % every == 0:
            for name, (_, student) in pairs.items():
                now = weights[student_name[id(student)]]
                expected[name] = (1 - rate) * expected[name] + rate * now
    moved = 0.0
    for name, (teacher, student) in pairs.items():
        torch.testing.assert_close(teacher.detach(), expected[name], rtol=1e-6,
                                   atol=1e-6 * expected[name].abs().max().item())
        moved = max(moved, (teacher - student).abs().max().item())
    assert moved > 1e-4  # the average lags the student: it is not a copy


def test_the_ema_adapter_scores_without_dropout_while_the_student_trains(tiny, prompts, tokenizer, make_config):
    # the "ema" adapter is added after GRPO's disable_dropout, so its own LoRA dropout layers are live ones; a teacher
    # scores in eval mode, and the student is left in the mode it was in (under ZeRO-3 the dropped units differed
    # from rank to rank, which is how this was found)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.5, target_modules="all-linear")
    trainer = OPDTrainer(model=str(tiny / "student"), train_dataset=prompts, peft_config=lora,
                         args=make_config(teacher_system_prompt=HINT, student_as_teacher="ema"))
    with torch.no_grad():
        for name, parameter in trainer.model.named_parameters():
            if ".ema." in name:  # an average away from the starting adapter, whose B is 0
                parameter.add_(torch.randn_like(parameter) * 0.3)
    trainer.model.train()
    batch = _batch(tokenizer, system=HINT)
    first, second = (trainer.teacher.score(*batch).logps for _ in range(2))
    assert torch.equal(first, second) and trainer.model.training
    trainer.model.eval()
    torch.testing.assert_close(trainer.teacher.score(*batch).logps, first, atol=0, rtol=0)

def test_ema_teacher_is_saved_with_each_checkpoint_and_restored_on_resume(tiny, prompts, make_config):
    from trl_opd.trainer.self_distillation import EMA_WEIGHTS

    def run(**overrides):
        return _trainer(tiny, prompts, make_config, peft=True, student_as_teacher="ema", teacher_ema_rate=0.5,
                        **{"learning_rate": 5e-2, "save_strategy": "steps", "save_steps": 2, "max_steps": 2,
                           **overrides})

    first = run()
    first.train()
    checkpoint = first.args.output_dir + "/checkpoint-2"
    saved = {name: teacher.detach().clone() for name, (teacher, _) in first.teacher_ema.pairs().items()}
    second = run(overwrite_output_dir=False, max_steps=3)
    second.train(resume_from_checkpoint=checkpoint)  # one more step, whose average starts from the saved one
    assert second.state.global_step == 3
    for name, (teacher, student) in second.teacher_ema.pairs().items():
        average = saved[name] + 0.5 * (student.detach() - saved[name])
        torch.testing.assert_close(teacher.detach(), average, rtol=1e-6, atol=1e-6 * average.abs().max().item())
    Path(checkpoint, EMA_WEIGHTS).unlink()
    with pytest.raises(ValueError, match=f"has no {EMA_WEIGHTS}"):
        run(overwrite_output_dir=False, max_steps=3).train(resume_from_checkpoint=checkpoint)


def test_an_ema_run_resumed_with_resume_from_checkpoint_true_restores_its_teacher(tiny, prompts, make_config):
    """`True` is resolved to the newest complete checkpoint before the 'ema' teacher reads it (the order of the
    trainer's parts: reading `True` as a path fails)."""
    def run(**overrides):
        return _trainer(tiny, prompts, make_config, peft=True, student_as_teacher="ema", teacher_ema_rate=0.5,
                        **{"learning_rate": 5e-2, "save_strategy": "steps", "save_steps": 2, "max_steps": 2,
                           **overrides})

    first = run()
    first.train()
    saved = {name: teacher.detach().clone() for name, (teacher, _) in first.teacher_ema.pairs().items()}
    resumed = run(overwrite_output_dir=False, max_steps=3)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3
    for name, (teacher, student) in resumed.teacher_ema.pairs().items():
        average = saved[name] + 0.5 * (student.detach() - saved[name])
        torch.testing.assert_close(teacher.detach(), average, rtol=1e-6, atol=1e-6 * average.abs().max().item())


def _constant_reward(completions, **kwargs):
    """A reward that is the same for every completion: GRPO's reward advantages are 0, only the teacher teaches."""
    return [1.0] * len(completions)


@pytest.mark.parametrize("kind", ["initial", "ema"])
@pytest.mark.parametrize("estimator", ["sampled", "topk", "full"])
def test_a_teacher_without_context_beside_a_reward_starts_equal_to_the_student_with_every_estimator(
        tiny, prompts, make_config, kind, estimator):
    # the student as its own teacher, reading what the student reads: every term is 0 at the first step (a pull
    # towards the starting weights beside a reward, which here is constant, so nothing else moves the student)
    config = make_config(student_as_teacher=kind, opd_estimator=estimator, teacher_system_prompt=None, max_steps=1,
                         learning_rate=5e-2, num_generations=2)
    trainer = OPDTrainer(model=str(tiny / "student"), args=config, train_dataset=prompts,
                         reward_funcs=[_constant_reward])
    trainer.train()
    first = _first(trainer)
    assert first["opd/reverse_kl"] == pytest.approx(0.0, abs=1e-5)
    dense = {"topk": "opd/reverse_kl_topk", "full": "opd/reverse_kl_dense"}.get(estimator)
    if dense:
        assert first[dense] == pytest.approx(0.0, abs=1e-5)
        assert first["grad_norm"] == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize(("kind", "rewards", "message"), [
    ("live", True, "is the student itself reading the same prompt"),
    ("live", False, "is the student itself reading the same prompt"),
    ("initial", False, "no teacher context and no reward functions"),
    ("ema", False, "no teacher context and no reward functions"),
])
def test_a_teacher_that_cannot_differ_from_the_student_is_refused_before_weights_load(
        tiny, prompts, make_config, kind, rewards, message, monkeypatch):
    # with no context, 'live' is the student itself (round-off as the signal, scaled by Adam into full steps), and
    # 'initial' or 'ema' alone never leave the student's starting point; none of it loads a model
    import transformers

    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(load))
    config = make_config(student_as_teacher=kind, teacher_system_prompt=None, num_generations=2)
    with pytest.raises(ValueError, match=message):
        OPDTrainer(model=str(tiny / "student"), args=config, train_dataset=prompts,
                   reward_funcs=[_constant_reward] if rewards else None)


@pytest.mark.parametrize("divergence", [0.0, 0.5])
def test_a_privileged_context_teaches_with_each_divergence(tiny, prompts, make_config, divergence):
    trainer = _trainer(tiny, prompts, make_config, peft=True, student_as_teacher="live", opd_estimator="full",
                       opd_divergence_beta=divergence, max_steps=1)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    name = {0.0: "opd/forward_kl_dense", 0.5: "opd/jsd_dense"}[divergence]
    assert _first(trainer, name)[name] > 1e-3
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if n in before)


def test_the_deprecated_student_base_option_is_the_initial_kind(tmp_path):
    with pytest.warns(FutureWarning, match="it is `student_as_teacher: initial`"):
        config = OPDConfig(output_dir=str(tmp_path), teacher_is_student_base=True, report_to="none", bf16=False)
    assert config.student_as_teacher == "initial" and config.teacher_source() == "self"


@pytest.mark.parametrize("options, message", [
    (dict(student_as_teacher="live", teacher_ema_rate=0.1), "teacher_ema_rate sets how the teacher follows"),
    (dict(student_as_teacher="ema", teacher_ema_rate=0.0), "teacher_ema_rate must be in"),
    (dict(student_as_teacher="ema", teacher_ema_steps=0), "teacher_ema_steps must be a positive"),
    (dict(student_as_teacher="ema", sync_ref_model=True, beta=0.1), "Remove sync_ref_model"),
    (dict(student_as_teacher="live", opd_estimator="full", num_iterations=2), "a teacher that never existed"),
    (dict(student_as_teacher="initial", teacher_tokenizer_mode="cross"), "is the student's own model"),
    (dict(student_as_teacher="initial", teacher_model_name_or_path="x"), "Choose one teacher source"),
    (dict(student_as_teacher="everyone"), "student_as_teacher must be one of"),
])
def test_what_cannot_work_is_refused_before_training(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        OPDConfig(output_dir=str(tmp_path), report_to="none", bf16=False, **options)


def test_teacher_temperature_is_refused_for_the_student_as_its_own_teacher(tiny, prompts, make_config):
    with pytest.raises(ValueError, match="scores at its sampling `temperature`"):
        _trainer(tiny, prompts, make_config, peft=False, student_as_teacher="live", teacher_temperature=2.0)


def test_a_moving_teacher_defaults_to_topk_where_full_would_read_a_moved_head(tmp_path):
    config = OPDConfig(output_dir=str(tmp_path), report_to="none", bf16=False, student_as_teacher="ema",
                       num_iterations=2)
    config = config.resolved()
    assert config.opd_estimator == "topk"
    config = OPDConfig(output_dir=str(tmp_path), report_to="none", bf16=False, student_as_teacher="ema")
    config = config.resolved()
    assert config.opd_estimator == "full"


# ------------------------------------------------------------------------------- options that go with it


def test_skipping_the_first_tokens_leaves_them_out_of_the_teachers_terms(tiny, prompts, make_config):
    trainer = _trainer(tiny, prompts, make_config, peft=False, student_as_teacher="live", opd_skip_first_tokens=3)
    output = trainer._generate_and_score_completions([prompts[i] for i in range(4)])
    mask, completion_mask = output["action_mask"], output["completion_mask"]
    assert (mask[:, :3] == 0).all() and torch.equal(mask[:, 3:], completion_mask[:, 3:])
    assert torch.equal(output["tool_mask"], mask) and int(output["num_items_in_batch"]) == int(mask.sum())
    with pytest.raises(ValueError, match="opd_skip_first_tokens must be 0 or more"):
        make_config(opd_skip_first_tokens=-1)


@pytest.mark.parametrize("k", [5, 486], ids=["top5", "whole-vocabulary"])
def test_topk_mass_of_each_side_is_logged(tiny, prompts, tokenizer, make_config, k):
    assert len(tokenizer) == 486
    config = make_config(student_as_teacher="initial", opd_estimator="topk", opd_topk=k, teacher_system_prompt=None,
                         max_steps=1, num_generations=2)
    trainer = OPDTrainer(model=str(tiny / "student"), args=config, train_dataset=prompts,
                         reward_funcs=[_constant_reward])
    trainer.train()
    first = _first(trainer, "opd/teacher_topk_mass")
    # the same model on the same tokens: both sides see the same share, all of it when k is the vocabulary
    assert first["opd/student_topk_mass"] == pytest.approx(first["opd/teacher_topk_mass"], abs=1e-5)
    if k == len(tokenizer):
        assert first["opd/teacher_topk_mass"] == pytest.approx(1.0, abs=1e-5)
    else:
        assert 0.05 < first["opd/teacher_topk_mass"] < 1.0 - 1e-3


def test_check_shows_the_students_prompt_beside_the_teachers_filled_template(tiny, tmp_path, capsys):
    from trl_opd.tools import cli

    argv = ["check", "--config", "recipes/smoke_cpu.yaml", "--model_name_or_path", str(tiny / "student"),
            "--teacher_model_name_or_path", "", "--student_as_teacher", "initial", "--dataset_name",
            str(tiny / "train.jsonl"), "--teacher_prompt_template", "{prompt} (It is {answer}.)",
            "--output_dir", str(tmp_path / "unused")]
    with pytest.raises(SystemExit) as exit_code:
        cli.main(argv)
    out = capsys.readouterr().out
    assert exit_code.value.code == 0
    student = out.split("first prompt, student's chat template: ")[1].splitlines()[0]
    teacher = out.split("first prompt, teacher's chat template: ")[1].splitlines()[0]
    question = student.split("user\\n")[1].split("<|im_end|>")[0]
    assert "It is" not in student and f"user\\n{question} (It is " in teacher
    assert "reference as teacher: opd/reverse_kl = 0.000000 (OK" in out


# ------------------------------------------------------------------------------- each kind's teacher, exactly


def _logps(logits, temperature=1.0):
    return (logits.float() / temperature).log_softmax(-1)


@pytest.mark.parametrize("kind", ["initial", "ema"])
@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_the_teacher_starts_from_the_student_as_passed_not_from_its_checkpoint(
        tiny, prompts, tokenizer, make_config, kind, peft):
    # GRPO builds its reference copy from the checkpoint the student's config names; a student that moved after
    # loading (an SFT stage in the same process) must still be its own starting teacher
    import copy

    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(tiny / "student", dtype=torch.float32)
    torch.manual_seed(0)
    _perturb(student)
    start = copy.deepcopy(student)
    trainer = OPDTrainer(model=student, args=make_config(teacher_system_prompt=HINT, student_as_teacher=kind),
                         train_dataset=prompts, peft_config=_lora() if peft else None)
    batch = _batch(tokenizer, system=HINT)
    expected = _scored_by(start, batch)
    assert (expected - _scored_by(AutoModelForCausalLM.from_pretrained(tiny / "student"), batch)).abs().max() > 0.1
    torch.testing.assert_close(trainer.teacher.score(*batch).logps, expected, rtol=1e-5,
                               atol=1e-5 * expected.abs().max().item())
    if not peft:  # GRPO's reference copy, which ref_as_teacher and the KL penalty read too, is the student as passed
        for name, param in trainer.ref_model.named_parameters():
            assert torch.equal(param, start.get_parameter(name)), name


def _student_variant(tiny, tmp_path, variant):
    """The tiny student as a path, with its head tied to its input embedding for 'full_tied'; a LoRA config that
    trains the head whole for 'lora_trained_head'."""
    if variant != "full_tied":
        return str(tiny / "student"), (LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                  modules_to_save=["lm_head"]) if variant.startswith("lora") else None)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny / "student")
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(tmp_path / "tied")
    AutoTokenizer.from_pretrained(tiny / "student").save_pretrained(tmp_path / "tied")
    return str(tmp_path / "tied"), None


@pytest.mark.parametrize("kind", ["initial", "live", "ema"])
@pytest.mark.parametrize("variant", ["lora_trained_head", "full", "full_tied"])
def test_the_loss_projects_the_teachers_hidden_states_through_the_head_that_scored(
        tiny, prompts, tokenizer, make_config, tmp_path, kind, variant):
    # the full estimator keeps the teacher's hidden states from scoring and projects them at the loss, where the
    # student's own adapter (and its trained head) is active: the teacher's head there must be the one that scored
    from trl.trainer.utils import use_adapter

    from trl_opd.loss import dense_reverse_kl

    path, peft_config = _student_variant(tiny, tmp_path, variant)
    trainer = OPDTrainer(model=path, train_dataset=prompts, peft_config=peft_config, args=make_config(
        teacher_system_prompt=HINT, student_as_teacher=kind, opd_estimator="full", temperature=0.7))
    model = trainer.model
    torch.manual_seed(0)
    with torch.no_grad():  # training moved the student's head, and the average (its own copy) moved apart from both
        student_head = trainer._student_head(trainer._student_causal_lm()).weight  # a tied one is the embedding
        assert student_head.requires_grad
        student_head.add_(torch.randn_like(student_head) * 0.1)
        for name, parameter in model.named_parameters():
            if peft_config and ".ema." in name:
                parameter.add_(torch.randn_like(parameter) * 0.5)
        for parameter in (trainer.ref_model.parameters() if kind == "ema" and trainer.ref_model else ()):
            parameter.add_(torch.randn_like(parameter) * 0.1)
    batch = _batch(tokenizer, system=HINT)
    scores = trainer.teacher.score(*batch)
    teacher_ids, completion = torch.cat([batch[0], batch[2]], 1), batch[2].size(1)
    with torch.no_grad():  # the teacher's own forward with the kind's weights, on its prompt
        if kind == "live":
            teacher_logits = model(teacher_ids).logits
        elif peft_config is None:
            teacher_logits = trainer.ref_model(teacher_ids).logits
        else:
            with use_adapter(model, adapter_name="ema" if kind == "ema" else None):
                teacher_logits = model(teacher_ids).logits
        teacher_logps = _logps(teacher_logits[0, -completion - 1 : -1], 0.7)
        head = trainer.teacher.output_head  # what the loss reads, with the student's adapter active again
        torch.testing.assert_close(head.logits(scores.hidden[0]).log_softmax(-1), teacher_logps, rtol=1e-5,
                                   atol=1e-5 * teacher_logps.abs().max().item())
        # the loss's exact reverse KL against the student on its own prompt equals the two forwards' by hand
        student_batch = _batch(tokenizer, system=None)
        student_ids = torch.cat([student_batch[0], student_batch[2]], 1)
        student_logps = _logps(model(student_ids).logits[0, -completion - 1 : -1], 0.7)
        by_hand = (student_logps.exp() * (student_logps - teacher_logps)).sum(-1)
        student = trainer._student_causal_lm()
        hidden = student.base_model(input_ids=student_ids).last_hidden_state[:, -completion - 1 : -1]
        kl = dense_reverse_kl(hidden, trainer._student_head(student), scores.hidden, head,
                              torch.ones(1, completion))[0]
    assert by_hand.min() > 1e-3, by_hand  # the student and its teacher differ
    torch.testing.assert_close(kl, by_hand, rtol=1e-4, atol=1e-4 * by_hand.abs().max().item())


def test_trainable_tokens_on_the_lm_head_are_refused(tiny, prompts, make_config):
    # the distillation terms project the head by its weight: the trained rows would be left out (GRPO refuses a LoRA
    # adapter on the head itself, not these)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"], trainable_token_indices={"lm_head": [1, 2]})
    with pytest.raises(ValueError, match="LM head carries trainable tokens"):
        OPDTrainer(model=str(tiny / "student"), train_dataset=prompts, peft_config=lora,
                   args=make_config(teacher_system_prompt=HINT, student_as_teacher="initial"))


def test_ema_with_full_fine_tuning_and_a_kl_penalty_is_refused(tiny, prompts, make_config):
    # the average lives in GRPO's reference copy, which the KL penalty reads as the starting model
    with pytest.raises(ValueError, match="keeps its moving average in GRPO's reference copy"):
        _trainer(tiny, prompts, make_config, peft=False, student_as_teacher="ema", beta=0.1)
    # with LoRA the reference is the base weights beside the "ema" adapter
    trainer = _trainer(tiny, prompts, make_config, peft=True, student_as_teacher="ema", beta=0.1)
    assert trainer.beta == 0.1 and trainer.ref_model is None


def test_the_ema_average_of_a_bf16_teacher_is_kept_in_float32(tiny, prompts, make_config):
    # in bf16 a step of rate * (student - teacher) under half a unit in the last place is lost: the norm weights
    # (1.0, whose unit is 2^-7) would never move at rate 0.05
    rate, steps = 0.05, 5
    trainer = _trainer(tiny, prompts, make_config, peft=False, student_as_teacher="ema", teacher_ema_rate=rate,
                       max_steps=steps, learning_rate=5e-2, model_init_kwargs={"dtype": "bfloat16"})
    recorder = _Recorder()
    trainer.callback_handler.callbacks.insert(0, recorder.callback(trainer))
    pairs = trainer.teacher_ema.pairs()
    assert all(teacher.dtype == torch.bfloat16 for teacher, _ in pairs.values())
    expected = {name: student.detach().float().clone() for name, (_, student) in pairs.items()}
    trainer.train()
    for weights in recorder.steps:
        for name in expected:
            expected[name] = expected[name] + rate * (weights[name].float() - expected[name])
    average = trainer.teacher_ema.average.state_dict(pairs)
    for name, (teacher, _) in pairs.items():
        scale = expected[name].abs().max().item()
        torch.testing.assert_close(average[name], expected[name], rtol=1e-5, atol=1e-6 * scale)
        assert torch.equal(teacher.detach(), average[name].to(torch.bfloat16)), name  # the average, rounded
    norms = [name for name in pairs if "norm" in name]
    assert norms and all(not torch.equal(pairs[name][0].float(), torch.ones_like(pairs[name][0].float()))
                         for name in norms)


@pytest.mark.parametrize("source", [dict(student_as_teacher="initial", teacher_system_prompt=HINT),
                                    dict(ref_as_teacher=True),
                                    dict(teacher_server_url="http://127.0.0.1:9")], ids=["self", "reference", "served"])
def test_teacher_model_init_kwargs_where_no_teacher_is_loaded_from_a_path_is_refused(tiny, prompts, make_config,
                                                                                   source):
    config = make_config(teacher_model_init_kwargs={"dtype": "bfloat16"}, **source)
    with pytest.raises(ValueError, match="teacher_model_init_kwargs loads a teacher model from a path"):
        OPDTrainer(model=str(tiny / "student"), args=config, train_dataset=prompts)
