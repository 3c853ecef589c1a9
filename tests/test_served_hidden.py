"""A served teacher that returns its final hidden states (`serve-teacher --hidden-states`), its head held here: the
`full` estimator from a real vLLM server, against the same teacher loaded locally."""

import json

import pytest
import torch
from transformers import TrainerCallback

from trl_opd import OPDTrainer
from trl_opd.teachers import LocalTeacher
from trl_opd.teachers.local import freeze_teacher
from trl_opd.teachers.served_hidden import HiddenStateTeacher, load_teacher_head
from trl_opd.tools.testing import padded_batch


def _close(actual, expected, rel=1e-5):
    """Equal to `rel` of the expected values' largest magnitude."""
    scale = expected.abs().max().clamp_min(1e-12)
    assert (actual - expected).abs().max() <= rel * scale, ((actual - expected).abs().max().item(), scale.item())


def test_a_hidden_state_server_scores_exactly_as_the_local_teacher(hidden_server, tiny, tokenizer):
    from transformers import AutoModelForCausalLM

    batch = padded_batch()
    served = HiddenStateTeacher([hidden_server, hidden_server], head=load_teacher_head(str(tiny / "teacher")),
                                batch_size=2, return_hidden=True, topk=5)  # 2 URLs: the batch is spread
    served.connect(tokenizer, student_name="tiny student")
    local = LocalTeacher(freeze_teacher(AutoModelForCausalLM.from_pretrained(tiny / "teacher")), batch_size=8,
                         return_hidden=True, topk=5)
    served_scores, local_scores = served.score(*batch), local.score(*batch)

    mask = batch[3].bool()
    _close(served_scores.hidden[mask], local_scores.hidden[mask])  # the head's input, after the final norm
    _close(served_scores.logps[mask], local_scores.logps[mask])
    _close(served_scores.entropy[mask], local_scores.entropy[mask])
    assert torch.equal(served_scores.is_top1[mask], local_scores.is_top1[mask])
    assert torch.equal(served_scores.topk_ids[mask], local_scores.topk_ids[mask])
    _close(served_scores.topk_logps[mask], local_scores.topk_logps[mask])
    assert served_scores.logps[~mask].abs().sum() == 0 and served_scores.hidden[~mask].abs().sum() == 0


def test_teacher_temperature_applies_to_a_head_held_here(hidden_server, tiny, tokenizer):
    from transformers import AutoModelForCausalLM

    batch = padded_batch(seed=1)
    served = HiddenStateTeacher(hidden_server, head=load_teacher_head(str(tiny / "teacher"), temperature=0.5))
    served.connect(tokenizer, student_name="tiny student")
    local = LocalTeacher(freeze_teacher(AutoModelForCausalLM.from_pretrained(tiny / "teacher")), batch_size=8,
                         temperature=0.5)
    mask = batch[3].bool()
    served_scores, local_scores = served.score(*batch), local.score(*batch)
    _close(served_scores.logps[mask], local_scores.logps[mask])
    untempered = HiddenStateTeacher(hidden_server, head=load_teacher_head(str(tiny / "teacher"))).score(*batch)
    assert (untempered.logps[mask] - served_scores.logps[mask]).abs().max() > 0.01


def test_a_served_teacher_warns_once_of_mass_beyond_the_students_vocabulary(hidden_server, tiny, tokenizer, caplog):
    # as a local teacher does (test_dense.py): the head is here, so the mass on its extra rows can be measured
    from trl_opd.heads import OutputHead

    head = load_teacher_head(str(tiny / "teacher"))
    larger = OutputHead(torch.cat([head.weight, head.weight[:16] * 5]))  # extra rows that outscore everything
    served = HiddenStateTeacher(hidden_server, head=larger, student_vocab_size=head.vocab_size)
    with caplog.at_level("WARNING"):
        served.score(*padded_batch(seed=2))
        served.score(*padded_batch(seed=3))
    warnings = [r.getMessage() for r in caplog.records if "beyond the student's vocabulary" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"on its 16 token ids beyond the student's vocabulary of {head.vocab_size}" in warnings[0]


def _length_reward(completions, **kwargs):
    return [len(completion) / 10 for completion in completions]


class _Gradients(TrainerCallback):
    """Each parameter's gradient before the first optimizer step."""

    def __init__(self, model):
        self.model, self.gradients = model, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.gradients is None:
            self.gradients = {name: p.grad.detach().clone() for name, p in self.model.named_parameters()
                              if p.grad is not None}


def _one_step(tiny, prompts, make_config, rewards=None, **config):
    trainer = OPDTrainer(model=str(tiny / "student"), train_dataset=prompts, args=make_config(max_steps=1, **config),
                         reward_funcs=rewards)
    gradients = _Gradients(trainer.model)
    trainer.add_callback(gradients)
    trainer.train()
    return trainer, next(entry for entry in trainer.state.log_history if "loss" in entry), gradients.gradients


@pytest.mark.parametrize("case", [
    dict(opd_divergence_beta=1.0),
    dict(opd_divergence_beta=0.0),
    dict(opd_divergence_beta=0.5, opd_coef=0.5),
    dict(opd_divergence_beta=1.0, rewards=[_length_reward], num_generations=2),
], ids=["reverse", "forward", "jsd+sampled", "reverse+rewards"])
def test_served_full_equals_local_full_loss_and_gradients(hidden_server, tiny, prompts, make_config, case):
    served, served_log, served_grads = _one_step(tiny, prompts, make_config, teacher_server_url=hidden_server,
                                                 opd_estimator=None, **case)
    assert served.args.opd_estimator == "full"  # the default where the server gives hidden states
    assert isinstance(served.teacher, HiddenStateTeacher)
    local, local_log, local_grads = _one_step(tiny, prompts, make_config, opd_estimator="full",
                                              teacher_model_name_or_path=str(tiny / "teacher"), **case)
    assert served_log["opd/reverse_kl_dense" if case["opd_divergence_beta"] == 1 else "loss"] > 0.01
    assert served_log["loss"] == pytest.approx(local_log["loss"], rel=1e-5)
    assert served_grads.keys() == local_grads.keys() and len(served_grads) > 0
    for name, gradient in local_grads.items():
        _close(served_grads[name], gradient)


@pytest.mark.parametrize("estimator", ["topk", "sampled"])
def test_the_other_estimators_from_a_hidden_state_server_equal_the_local_teachers(hidden_server, tiny, prompts,
                                                                                   make_config, estimator):
    served, served_log, served_grads = _one_step(tiny, prompts, make_config, teacher_server_url=hidden_server,
                                                 opd_estimator=estimator)
    local, local_log, local_grads = _one_step(tiny, prompts, make_config, opd_estimator=estimator,
                                              teacher_model_name_or_path=str(tiny / "teacher"))
    for name in ("loss", "opd/reverse_kl", "opd/teacher_agreement", "opd/teacher_entropy"):
        assert served_log[name] == pytest.approx(local_log[name], rel=1e-5, abs=1e-7), name
    assert abs(served_log["loss"]) > 1e-3
    for name, gradient in local_grads.items():
        _close(served_grads[name], gradient)


def test_rows_routed_to_a_hidden_state_server_and_a_local_teacher(hidden_server, tiny, make_config):
    from datasets import Dataset

    rows = [json.loads(line) for line in open(tiny / "train.jsonl")][:8]
    dataset = Dataset.from_list([{"prompt": row["prompt"], "teacher": route}
                                 for row, route in zip(rows, ["local", "served"] * 4, strict=True)])
    teachers = {"local": str(tiny / "teacher"), "served": hidden_server}
    trainer = OPDTrainer(model=str(tiny / "student"), train_dataset=dataset,
                         args=make_config(max_steps=1, teachers=teachers, opd_estimator=None))
    assert trainer.args.opd_estimator == "full"  # both give hidden states
    assert isinstance(trainer.teacher.scorers["served"], HiddenStateTeacher)
    batch = padded_batch()
    routed = trainer.teacher.score(*batch, routes=["served", "local", "served", "served", "local"])
    local = trainer.teacher.scorers["local"].score(*batch)
    mask = batch[3].bool()
    _close(routed.logps[mask], local.logps[mask])  # the same model behind both routes
    _close(routed.entropy[mask], local.entropy[mask])  # both give it, so the routed batch does too
    _close(routed.hidden[mask], local.hidden[mask])  # each row's states, for its own teacher's head
    assert routed.hidden_route.tolist() == [1, 0, 1, 1, 0]  # the order of `teachers`
    trainer.train()
    logged = next(entry for entry in trainer.state.log_history if "opd/reverse_kl" in entry)
    assert logged["opd/reverse_kl_dense"] > 0.01


def test_the_default_estimator_of_a_served_teacher_is_what_its_server_gives(hidden_server, teacher_server, tiny,
                                                                            make_config):
    for url, expected in ((hidden_server, "full"), (teacher_server, "topk")):
        args = make_config(opd_estimator=None, teacher_server_url=url)
        args = args.resolved()
        assert args.opd_estimator == expected
        args = make_config(opd_estimator=None)
        args = args.resolved(teacher_model=url)  # a server given to the trainer
        assert args.opd_estimator == expected
        # routed beside a local teacher: what the server gives decides
        args = make_config(opd_estimator=None, teachers={"local": str(tiny / "teacher"), "served": url})
        args = args.resolved()
        assert args.opd_estimator == expected
    args = make_config(opd_estimator=None, teachers={"a": str(tiny / "teacher"), "b": str(tiny / "student")})
    args = args.resolved()
    assert args.opd_estimator == "full"  # local teachers give everything
    with pytest.raises(ValueError, match="servers differ: .* return hidden states .* and .* log-probs"):
        make_config(opd_estimator=None, teacher_server_url=[hidden_server, teacher_server]).resolved()


# ------------------------------------------------------------------------------------------------ bad input


def _fake_teacher(tokenizer, info, hidden=None):
    """A fake server that tokenizes as `tokenizer`, answers /opd/info with `info` (404 when None) and /opd/hidden
    with `hidden()`'s (status, answer, headers)."""
    from trl_opd.tools.testing import LoopbackHTTPServer

    def respond(path, headers, body):
        if path == "/opd/info":
            return (404, {"detail": "Not Found"}) if info is None else (200, info)
        if path == "/v1/models":
            return 200, {"data": [{"id": "fake/teacher"}]}
        if path == "/tokenize":
            return 200, {"tokens": tokenizer(body["prompt"], add_special_tokens=False)["input_ids"]}
        if path == "/opd/hidden" and hidden is not None:
            return hidden(body)
        return 200, {}

    return LoopbackHTTPServer(respond)


def test_full_from_a_server_without_hidden_states_is_refused_naming_the_flag(teacher_server, tiny, tokenizer, prompts,
                                                                            make_config):
    student = str(tiny / "student")
    message = "gives log-probs only: start it with `trl-opd serve-teacher MODEL --hidden-states`"
    with pytest.raises(ValueError, match=message):  # a log-prob server, named in the config or given to the trainer
        OPDTrainer(model=student, train_dataset=prompts, args=make_config(opd_estimator="full",
                                                                          teacher_server_url=teacher_server))
    with pytest.raises(ValueError, match=message):
        OPDTrainer(model=student, teacher_model=teacher_server, train_dataset=prompts,
                   args=make_config(opd_estimator="full"))
    with _fake_teacher(tokenizer, info=None) as stock, pytest.raises(ValueError, match=message):  # vLLM's own server
        OPDTrainer(model=student, train_dataset=prompts, args=make_config(opd_estimator="full",
                                                                          teacher_server_url=stock.url))


def test_a_head_that_does_not_take_the_served_states_is_refused(hidden_server, tiny, tokenizer, prompts, make_config):
    with pytest.raises(ValueError, match="returns hidden states of size 96, but the teacher head loaded here takes 64"):
        OPDTrainer(model=str(tiny / "student"), train_dataset=prompts,  # the student's checkpoint, not the served one
                   args=make_config(teacher_server_url=hidden_server, teacher_model_name_or_path=str(tiny / "student")))
    info = {"version": 1, "hidden_states": True, "hidden_size": 96, "dtype": "float8_e4m3fn"}
    with _fake_teacher(tokenizer, info) as fake, pytest.raises(ValueError, match="serves its hidden states as "
                                                                                 "'float8_e4m3fn'; the head takes"):
        OPDTrainer(model=str(tiny / "student"), train_dataset=prompts, args=make_config(
            teacher_server_url=fake.url, teacher_model_name_or_path=str(tiny / "teacher")))


def test_a_checkpoint_without_the_head_or_with_a_smaller_vocabulary_is_refused(hidden_server, tiny, prompts,
                                                                              make_config, tmp_path):
    import shutil

    from safetensors.torch import save_file

    def checkpoint(name, tensors):
        directory = tmp_path / name
        directory.mkdir()
        shutil.copy(tiny / "teacher" / "config.json", directory)
        if tensors is not None:
            save_file(tensors, directory / "model.safetensors")
        return str(directory)

    with pytest.raises(FileNotFoundError, match="has no model.safetensors or model.safetensors.index.json"):
        load_teacher_head(checkpoint("no_weights", None))
    with pytest.raises(ValueError, match="holds no head tensor: looked for lm_head.weight in model.safetensors"):
        load_teacher_head(checkpoint("no_head", {"model.norm.weight": torch.ones(96)}))
    small = checkpoint("small_vocabulary", {"lm_head.weight": torch.zeros(100, 96)})
    with pytest.raises(ValueError, match="outputs 100 logits per token but the student .* can sample 486"):
        OPDTrainer(model=str(tiny / "student"), train_dataset=prompts,
                   args=make_config(teacher_server_url=hidden_server, teacher_model_name_or_path=small))


def test_a_dropped_answer_is_retried_and_a_malformed_one_stops_the_batch(tiny, tokenizer):
    import numpy as np

    head = load_teacher_head(str(tiny / "teacher"))
    states = torch.randn(2, 96)
    good = (200, states.numpy().astype("<f4").tobytes(),
            {"X-OPD-Lengths": "2", "X-OPD-Dtype": "float32", "X-OPD-Hidden-Size": "96"})
    answers = [(503, {}), good]
    info = {"version": 1, "hidden_states": True, "hidden_size": 96, "dtype": "float32"}
    batch = (torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long), torch.tensor([[7, 8]]),
             torch.ones(1, 2, dtype=torch.long))
    with _fake_teacher(tokenizer, info, hidden=lambda body: answers.pop(0) if len(answers) > 1 else answers[0]) as fake:
        teacher = HiddenStateTeacher(fake.url, head=head, backoff=0.0, return_hidden=True)
        scores = teacher.score(*batch)
        assert len([r for r in fake.requests if r[0] == "/opd/hidden"]) == 2  # the 503, then the answer
        torch.testing.assert_close(scores.hidden[0], states, rtol=0, atol=0)
        expected = head.logits(states).log_softmax(-1).gather(-1, torch.tensor([[7], [8]]))[:, 0]
        torch.testing.assert_close(scores.logps[0], expected)
        answers[:] = [(200, np.zeros(3 * 96, dtype="<f4").tobytes(), good[2])]  # 3 positions for 2 tokens
        with pytest.raises(Exception, match=r"answered /opd/hidden for sequences 0..0 with \[2\] positions \(288"):
            teacher.score(*batch)


def test_serve_teacher_refuses_hidden_states_from_an_older_vllm(tmp_path, capsys):
    from trl_opd.tools import serve

    old = tmp_path / "python"  # an interpreter whose vllm is 0.30
    old.write_text("#!/bin/sh\necho \"__version__ = version = '0.30.1'\"\n")
    old.chmod(0o755)
    with pytest.raises(SystemExit, match=r"--hidden-states needs vLLM 0\.31 or later .* has vLLM 0\.30"):
        serve.main(["some/model", "--hidden-states", "--python", str(old)])
    serve.main(["some/model", "--hidden-states", "--python", str(old), "--dry-run"])  # the flags it would pass
    printed = capsys.readouterr().out
    assert "--runner pooling --convert embed" in printed and "/opd/hidden" in printed
