"""Overlapped teacher scoring (`opd_overlap_scoring`) with the real vLLM teacher server: each batch scored once, one
update stale at most, pi_old the sampling policy's, a teacher failure a clear stop with intact checkpoints."""

import math
import time
from pathlib import Path

import pytest
import torch

from trl_opd import OPDConfig, OPDTrainer
from trl_opd.tools.testing import DelayedTeacherProxy, LoopbackHTTPServer


def _logs(trainer, name):
    return [entry[name] for entry in trainer.state.log_history if name in entry]


def _record_sampling(trainer):
    """Keep, for every batch the trainer generates, the student's weights at that moment and the generation."""
    sampled = []
    generate = trainer._generate_for_teacher

    def recording(inputs, **kwargs):
        weights = {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}
        output = generate(inputs, **kwargs)
        sampled.append((weights, output))
        return output

    trainer._generate_for_teacher = recording
    return sampled


def _count_scoring(trainer):
    scored = []
    score = trainer.teacher.score

    def counting(prompt_ids, prompt_mask, completion_ids, completion_mask):
        scored.append(completion_ids.clone())
        return score(prompt_ids, prompt_mask, completion_ids, completion_mask)

    trainer.teacher.score = counting
    return scored


def test_each_batch_is_scored_once_one_update_stale_with_the_sampling_policys_old_logps(
    teacher_server, tiny, prompts, make_config
):
    config = make_config(max_steps=3, learning_rate=1e-2, teacher_server_url=teacher_server, opd_overlap_scoring=True)
    trainer = OPDTrainer(model=str(tiny / "student"), args=config, train_dataset=prompts)
    sampled, scored = _record_sampling(trainer), _count_scoring(trainer)
    trainer.train()

    # windows 0, 1, 2: the first batch and the second both sampled before the first update, the third before the
    # second; nothing is generated for a step past max_steps
    assert len(sampled) == len(scored) == 3
    for (_, output), completion_ids in zip(sampled, scored, strict=True):
        assert torch.equal(output["completion_ids"], completion_ids)  # scored once each, in order
    assert _logs(trainer, "opd/staleness") == [0.0, 1.0, 1.0]

    # pi_old is the sampling policy's, by value: a fresh student with the weights at sampling time gives it again,
    # and the weights one update later (what the batch is trained from) do not (training is over: the trained
    # student is reloaded with each)
    student = trainer.model
    for i, (weights, output) in enumerate(sampled):
        student.load_state_dict(weights)
        mask = output["completion_mask"].bool()
        again = trainer._no_grad_logps(student, torch.cat([output["prompt_ids"], output["completion_ids"]], 1),
                                       torch.cat([output["prompt_mask"], output["completion_mask"]], 1),
                                       output["completion_ids"].size(1))
        assert torch.allclose(again[mask], output["old_per_token_logps"][mask], atol=1e-5), i
    student.load_state_dict(sampled[2][0])  # the weights after the first update, which train the second batch
    _, second = sampled[1]
    later = trainer._no_grad_logps(student, torch.cat([second["prompt_ids"], second["completion_ids"]], 1),
                                   torch.cat([second["prompt_mask"], second["completion_mask"]], 1),
                                   second["completion_ids"].size(1))
    assert (later - second["old_per_token_logps"])[second["completion_mask"].bool()].abs().max() > 1e-4

    # the first step is today's synchronous step: same samples, same KL and loss
    sync = OPDTrainer(model=str(tiny / "student"), args=make_config(
        max_steps=1, learning_rate=1e-2, teacher_server_url=teacher_server), train_dataset=prompts)
    sync.train()
    assert _logs(trainer, "opd/reverse_kl")[0] == pytest.approx(_logs(sync, "opd/reverse_kl")[0], rel=1e-6, abs=1e-7)
    assert _logs(trainer, "loss")[0] == pytest.approx(_logs(sync, "loss")[0], rel=1e-6, abs=1e-7)


def test_the_completions_table_shows_the_trained_batch_beside_its_own_advantages(
    teacher_server, tiny, prompts, make_config
):
    config = make_config(max_steps=3, teacher_server_url=teacher_server, opd_overlap_scoring=True)
    trainer = OPDTrainer(model=str(tiny / "student"), args=config, train_dataset=prompts)
    generate, finish = trainer._generate_for_teacher, trainer._signal
    generated, trained = {}, []

    def table():
        return list(trainer._logs["prompt"]), list(trainer._logs["completion"])

    def recording(inputs, **kwargs):
        output = generate(inputs, **kwargs)
        generated[id(output)] = table()  # GRPO's table right after generating: this batch's rows
        return output

    def finishing(output, scores, **kwargs):
        result = finish(output, scores, **kwargs)
        mask = result["action_mask"]
        advantages = ((result["advantages"] * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist()
        trained.append((generated[id(output)], table(), list(trainer._logs["advantages"]), advantages))
        return result

    trainer._generate_for_teacher, trainer._signal = recording, finishing
    trainer.train()

    assert len(trained) == 3 and len(generated) == 3
    for step, (own_rows, shown_rows, shown_advantages, advantages) in enumerate(trained):
        assert shown_rows == own_rows, f"step {step}: the table shows another batch's prompts and completions"
        assert shown_advantages == pytest.approx(advantages, abs=1e-6)
    assert trained[1][1] != trained[2][1]  # each step's table is its own batch's (the prompts differ)


def test_a_teacher_failure_mid_pipeline_stops_with_a_clear_error_and_intact_checkpoints(
    teacher_server, tiny, prompts, make_config
):
    import requests
    from safetensors.torch import load_file

    completions = []

    def forward(path, headers, body):  # the real server, until the third scoring request after start-up's probe
        if path in ("/opd/score", "/v1/completions"):
            completions.append(path)
            if len(completions) == 4:
                return 400, {"error": "injected: this request is refused"}
        method = "GET" if body is None else "POST"
        answer = requests.request(method, teacher_server + path, json=body, timeout=60)
        return answer.status_code, answer.content

    with LoopbackHTTPServer(forward, record=False) as proxy:
        config = make_config(max_steps=3, save_strategy="steps", save_steps=1, opd_overlap_scoring=True,
                             teacher_server_url=proxy.url)
        trainer = OPDTrainer(model=str(tiny / "student"), args=config, train_dataset=prompts)
        # the third batch, sampled at step 1 and scored during the second update, is refused: step 2 stops
        with pytest.raises(RuntimeError, match=r"Step 2: the teacher failed scoring the batch sampled at step 1 "
                                               r"\(opd_overlap_scoring\): TeacherServerError: .*HTTP 400.*injected"):
            trainer.train()

    output_dir = Path(config.output_dir)
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    saved = load_file(output_dir / "checkpoint-2" / "model.safetensors")
    assert all(torch.equal(saved[name], p) for name, p in trainer.model.state_dict().items())  # the last update's

    resumed = OPDTrainer(model=str(tiny / "student"), args=make_config(
        max_steps=3, save_strategy="steps", save_steps=1, opd_overlap_scoring=True, teacher_server_url=teacher_server),
        train_dataset=prompts)
    resumed.train(resume_from_checkpoint=str(output_dir / "checkpoint-2"))
    assert resumed.state.global_step == 3 and math.isfinite(_logs(resumed, "opd/reverse_kl")[-1])


def test_the_delayed_proxy_forwards_after_its_delay(teacher_server):
    import requests

    model = requests.get(teacher_server + "/v1/models", timeout=30).json()["data"][0]["id"]
    request = {"model": model, "prompt": "12 + 7 = 19", "add_special_tokens": False}
    with DelayedTeacherProxy(teacher_server, delay=0.3) as proxy:
        start = time.perf_counter()
        tokens = requests.post(proxy.url + "/tokenize", json=request, timeout=30).json()["tokens"]
        assert time.perf_counter() - start >= 0.3
        assert requests.get(proxy.url + "/v1/models", timeout=30).json()["data"][0]["id"] == model
    assert tokens == requests.post(teacher_server + "/tokenize", json=request, timeout=30).json()["tokens"]
    with pytest.raises(ValueError, match="on this machine only"):
        DelayedTeacherProxy("http://10.0.0.7:8000", delay=0.1)


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(teacher_model_name_or_path="some/teacher"), "a local teacher model .* nothing to overlap"),
    (dict(ref_as_teacher=True), "ref_as_teacher .* nothing to overlap"),
    (dict(teachers={"math": "http://127.0.0.1:8000", "code": "some/teacher"}), "routed teachers with a local model"),
    (dict(teacher_server_url="http://127.0.0.1:8000", num_iterations=2), "num_iterations=2 .* more updates stale"),
    (dict(teacher_server_url="http://127.0.0.1:8000", steps_per_generation=2),
     "steps_per_generation=2 with gradient_accumulation_steps=1 makes 2"),
])
def test_combinations_overlap_cannot_honour_are_refused(overrides, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        OPDConfig(output_dir=str(tmp_path), bf16=False, opd_overlap_scoring=True, **overrides)


def test_a_local_teacher_model_given_to_the_trainer_is_refused(tiny, prompts, make_config):
    with pytest.raises(ValueError, match="a local teacher model .* nothing to overlap"):
        OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"),
                   args=make_config(opd_overlap_scoring=True), train_dataset=prompts)
