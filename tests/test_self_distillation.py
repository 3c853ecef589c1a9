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
    torch.testing.assert_close(scores, student, atol=1e-6, rtol=0)
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
    torch.testing.assert_close(trainer.teacher.score(*batch).logps, _scored_by(start, batch), atol=1e-6, rtol=0)
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
    pairs = trainer._teacher_ema_pairs()
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
        torch.testing.assert_close(teacher.detach(), expected[name], atol=1e-6, rtol=0)
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
    from trl_opd.self_distillation import EMA_WEIGHTS

    def run(**overrides):
        return _trainer(tiny, prompts, make_config, peft=True, student_as_teacher="ema", teacher_ema_rate=0.5,
                        **{"learning_rate": 5e-2, "save_strategy": "steps", "save_steps": 2, "max_steps": 2,
                           **overrides})

    first = run()
    first.train()
    checkpoint = first.args.output_dir + "/checkpoint-2"
    saved = {name: teacher.detach().clone() for name, (teacher, _) in first._teacher_ema_pairs().items()}
    second = run(overwrite_output_dir=False, max_steps=3)
    second.train(resume_from_checkpoint=checkpoint)  # one more step, whose average starts from the saved one
    assert second.state.global_step == 3
    for name, (teacher, student) in second._teacher_ema_pairs().items():
        torch.testing.assert_close(teacher.detach(), saved[name] + 0.5 * (student.detach() - saved[name]),
                                   atol=1e-6, rtol=0)
    Path(checkpoint, EMA_WEIGHTS).unlink()
    with pytest.raises(ValueError, match=f"has no {EMA_WEIGHTS}"):
        run(overwrite_output_dir=False).train(resume_from_checkpoint=checkpoint)


@pytest.mark.parametrize("kind", ["initial", "live", "ema"])
@pytest.mark.parametrize("estimator", ["sampled", "topk", "full"])
def test_each_kind_without_context_starts_equal_to_its_teacher_with_every_estimator(
        tiny, prompts, make_config, kind, estimator):
    # the student as its own teacher, reading what the student reads: every term is 0 at the first step, and it is
    # the context that gives the teacher something to teach
    trainer = _trainer(tiny, prompts, make_config, peft=False, student_as_teacher=kind, opd_estimator=estimator,
                       teacher_system_prompt=None, max_steps=1, learning_rate=5e-2)
    trainer.train()
    first = _first(trainer)
    assert first["opd/reverse_kl"] == pytest.approx(0.0, abs=1e-5)
    dense = {"topk": "opd/reverse_kl_topk", "full": "opd/reverse_kl_dense"}.get(estimator)
    if dense:
        assert first[dense] == pytest.approx(0.0, abs=1e-5)
        assert first["grad_norm"] == pytest.approx(0.0, abs=1e-5)


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
    config.resolve_estimator()
    assert config.opd_estimator == "topk"
    config = OPDConfig(output_dir=str(tmp_path), report_to="none", bf16=False, student_as_teacher="ema")
    config.resolve_estimator()
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
    trainer = _trainer(tiny, prompts, make_config, peft=False, student_as_teacher="live", opd_estimator="topk",
                       opd_topk=k, teacher_system_prompt=None, max_steps=1)
    trainer.train()
    first = _first(trainer, "opd/teacher_topk_mass")
    # the same model on the same tokens: both sides see the same share, all of it when k is the vocabulary
    assert first["opd/student_topk_mass"] == pytest.approx(first["opd/teacher_topk_mass"], abs=1e-5)
    if k == len(tokenizer):
        assert first["opd/teacher_topk_mass"] == pytest.approx(1.0, abs=1e-5)
    else:
        assert 0.05 < first["opd/teacher_topk_mass"] < 1.0 - 1e-3


def test_check_shows_the_students_prompt_beside_the_teachers_filled_template(tiny, tmp_path, capsys):
    from trl_opd import cli

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
