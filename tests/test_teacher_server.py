"""The served teacher: a real vLLM server for the happy paths, a small fake HTTP server only to inject faults."""

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from transformers import TrainerCallback

from trl_opd import OPDTrainer
from trl_opd.teachers import LocalTeacher
from trl_opd.teachers.local import freeze_teacher
from trl_opd.teachers.vllm_server import TeacherServerError, VLLMServerTeacher
from trl_opd.tools.serve import ROUTE_DIR, server_env, vllm_command
from trl_opd.tools.testing import LoopbackHTTPServer, free_port, padded_batch

# ------------------------------------------------------------------------------------------------ real server


def test_served_scores_equal_the_local_teacher(teacher_server, tiny, tokenizer):
    from transformers import AutoModelForCausalLM

    batch = padded_batch()
    served = VLLMServerTeacher([teacher_server, teacher_server], batch_size=2)  # 2 URLs: the batch is spread
    served.connect(tokenizer, student_name="tiny student")
    local = LocalTeacher(freeze_teacher(AutoModelForCausalLM.from_pretrained(tiny / "teacher")), batch_size=8)
    served_scores, local_scores = served.score(*batch), local.score(*batch)

    mask = batch[3].bool()
    assert served_scores.logps.shape == batch[2].shape
    assert (served_scores.logps[mask] - local_scores.logps[mask]).abs().max() < 1e-4
    assert torch.equal(served_scores.is_top1[mask], local_scores.is_top1[mask])  # from vLLM's rank field
    assert served_scores.entropy is None
    assert served_scores.logps[~mask].abs().sum() == 0


def test_served_topk_equals_the_local_teachers_and_trains(teacher_server, tiny, tokenizer, prompts, make_config):
    from transformers import AutoModelForCausalLM

    batch = padded_batch()
    served = VLLMServerTeacher(teacher_server, batch_size=2, topk=5)
    served.connect(tokenizer, student_name="tiny student")
    local = LocalTeacher(freeze_teacher(AutoModelForCausalLM.from_pretrained(tiny / "teacher")), batch_size=8, topk=5)
    served_scores, local_scores = served.score(*batch), local.score(*batch)
    mask = batch[3].bool()
    assert served_scores.topk_ids.shape == (*batch[2].shape, 5)
    assert torch.equal(served_scores.topk_ids[mask], local_scores.topk_ids[mask])
    assert (served_scores.topk_logps[mask] - local_scores.topk_logps[mask]).abs().max() < 1e-4

    trainer = OPDTrainer(
        model=str(tiny / "student"), train_dataset=prompts,
        args=make_config(max_steps=2, teacher_server_url=teacher_server, opd_estimator=None),
    )
    assert (trainer.args.opd_estimator, trainer.args.opd_topk, trainer.args.opd_coef) == ("topk", 20, 0.0)  # defaults
    trainer.train()
    first = _opd_logs(trainer)[0]
    assert first["opd/reverse_kl_topk"] > 0.1
    assert first["loss"] == pytest.approx(first["opd/reverse_kl_topk"], rel=1e-4)  # the dense term alone


@pytest.mark.parametrize("topk", [0, 5])
def test_the_compact_endpoint_scores_exactly_as_the_stock_one(teacher_server, tokenizer, topk):
    batch = padded_batch()
    served = VLLMServerTeacher(teacher_server, batch_size=2, topk=topk)
    served.connect(tokenizer, student_name="tiny student")
    assert served.compact == {teacher_server: True}  # `trl-opd serve-teacher` adds /opd/score
    compact = served.score(*batch)
    served.compact[teacher_server] = False  # what a stock vLLM server answers, through /v1/completions
    stock = served.score(*batch)
    mask = batch[3].bool()
    assert torch.equal(compact.logps, stock.logps) and compact.logps[mask].abs().min() > 0
    assert torch.equal(compact.is_top1, stock.is_top1)
    if topk:
        assert torch.equal(compact.topk_ids, stock.topk_ids) and torch.equal(compact.topk_logps, stock.topk_logps)


def test_the_compact_endpoint_says_what_is_wrong_with_a_request(teacher_server):
    import requests

    def post(**request):
        answer = requests.post(teacher_server + "/opd/score", json=request, timeout=60)
        error = answer.json()["error"]  # vLLM's own refusals come in its error object
        return answer.status_code, error["message"] if isinstance(error, dict) else error

    assert post(sequences=[[5, 6, 7]], score_from=[0]) == (
        400, "bad /opd/score request: score_from 0 must be in [1, 3] (position 0 has no log-prob)")
    assert post(sequences=[[5, 6, 7]], score_from=[1, 2])[1].endswith("must be lists of the same length")
    status, error = post(sequences=[[5, 6, 7]], score_from=[1], topk=21)  # the server allows 20
    assert status == 400 and "prompt logprobs of 21, which is greater than max allowed: 20" in error


def test_topk_beyond_the_servers_limit_is_refused_at_start_up(teacher_server, tokenizer):
    served = VLLMServerTeacher(teacher_server, topk=21)  # serve-teacher allows 20
    with pytest.raises(TeacherServerError, match=r"HTTP 400(.|\n)*--max-logprobs 21 or more, or lower opd_topk"):
        served.connect(tokenizer, student_name="tiny student")


def _long_batch(total, *, prompt_length=100):
    """Two sequences sharing a prompt: row 0 a 20-token completion, row 1 one making `total` tokens in all."""
    ids = torch.randint(3, 480, (total,), generator=torch.Generator().manual_seed(0))
    prompt_ids, completion_ids = ids[:prompt_length].repeat(2, 1), ids[prompt_length:].repeat(2, 1)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[0, 20:] = 0
    return prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask


def test_a_sequence_one_token_short_of_max_model_len_is_scored_like_the_local_teacher(teacher_server, tiny,
                                                                                       tokenizer):
    from transformers import AutoModelForCausalLM

    served = VLLMServerTeacher(teacher_server)
    served.connect(tokenizer, student_name="tiny student")
    assert served.max_model_lens == {teacher_server: 512}  # read from /v1/models
    batch = _long_batch(511)  # the longest a --max-model-len 512 server scores
    local = LocalTeacher(freeze_teacher(AutoModelForCausalLM.from_pretrained(tiny / "teacher")), batch_size=8)
    served_scores, local_scores = served.score(*batch), local.score(*batch)
    mask = batch[3].bool()
    assert served_scores.logps.shape == (2, 411) and mask[1].all()
    assert (served_scores.logps[mask] - local_scores.logps[mask]).abs().max() < 1e-4
    # causal: the short row's log-probs are the long row's first ones
    assert (served_scores.logps[0, :20] - served_scores.logps[1, :20]).abs().max() < 1e-5


@pytest.mark.parametrize("total", [512, 513])
def test_a_sequence_at_or_over_max_model_len_is_refused_before_any_request(teacher_server, tokenizer, monkeypatch,
                                                                           total):
    served = VLLMServerTeacher(teacher_server, batch_size=1)  # the short row alone in a chunk, sent first otherwise
    served.connect(tokenizer, student_name="tiny student")
    sent, request = [], served._session.request

    def counted(*args, **kwargs):
        sent.append(args)
        return request(*args, **kwargs)

    monkeypatch.setattr(served._session, "request", counted)
    message = (
        rf"{teacher_server} cannot score sequence 1: its prompt \(100 tokens\) plus completion \({total - 100} "
        rf"tokens\) is {total} tokens, and a server started with --max-model-len 512 scores at most 511 .* "
        rf"--max-model-len {total + 1} or more .* or lower max_completion_length or shorten the prompts\."
    )
    batch = _long_batch(total)
    with pytest.raises(TeacherServerError, match=message):
        served.score(*batch)
    assert sent == []

    # the check is not stricter than the server: vLLM itself refuses the sequence
    sequence = torch.cat([batch[0][1], batch[2][1]]).tolist()
    with pytest.raises(TeacherServerError, match="HTTP 400"):
        served._score_chunk(teacher_server, [sequence[:100]], [sequence[100:]], first_index=1)
    assert len(sent) == 1


def _opd_logs(trainer):
    return [entry for entry in trainer.state.log_history if "opd/reverse_kl" in entry]


def test_served_teacher_trains_the_student_like_the_local_one(teacher_server, tiny, prompts, make_config):
    served = OPDTrainer(
        model=str(tiny / "student"), args=make_config(max_steps=2, teacher_server_url=teacher_server),
        train_dataset=prompts,
    )
    assert served.teacher_model is None
    before = [p.detach().clone() for p in served.model.parameters()]
    served.train()
    assert all(not torch.equal(a, b) for a, b in zip(before, served.model.parameters(), strict=True))
    logs = _opd_logs(served)
    assert len(logs) == 2 and all(math.isfinite(entry["opd/reverse_kl"]) for entry in logs)
    assert "opd/teacher_agreement" in logs[0] and "opd/teacher_entropy" not in logs[0]

    # same seed and data with the local teacher: same samples, same first-step KL
    local = OPDTrainer(
        model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=make_config(max_steps=1),
        train_dataset=prompts,
    )
    local.train()
    assert logs[0]["opd/reverse_kl"] == pytest.approx(_opd_logs(local)[0]["opd/reverse_kl"], abs=1e-4)
    assert logs[0]["opd/teacher_agreement"] == pytest.approx(_opd_logs(local)[0]["opd/teacher_agreement"])


def test_served_teacher_equal_to_student_gives_zero_kl(teacher_server, tiny, prompts, make_config):
    # the server serves the tiny teacher, so make that model the student too
    trainer = OPDTrainer(
        model=str(tiny / "teacher"), args=make_config(max_steps=1, teacher_server_url=teacher_server),
        train_dataset=prompts,
    )
    trainer.train()
    first = next(entry for entry in trainer.state.log_history if "opd/reverse_kl" in entry)
    assert first["opd/reverse_kl"] == pytest.approx(0.0, abs=1e-4)


def test_rows_routed_to_a_served_and_a_local_teacher(teacher_server, tiny, make_config):
    from datasets import Dataset

    rows = [json.loads(line) for line in open(tiny / "train.jsonl")][:8]
    routes = ["local", "served"] * 4
    dataset = Dataset.from_list([{"prompt": r["prompt"], "teacher": t} for r, t in zip(rows, routes, strict=True)])
    teachers = {"local": str(tiny / "teacher"), "served": teacher_server}
    trainer = OPDTrainer(model=str(tiny / "student"), args=make_config(max_steps=1, teachers=teachers),
                         train_dataset=dataset)
    batch = padded_batch()
    routes = ["local", "served", "local", "served", "served"]
    routed = trainer.teacher.score(*batch, routes=routes)
    local = trainer.teacher.scorers["local"].score(*batch)
    mask = batch[3].bool()
    assert (routed.logps[mask] - local.logps[mask]).abs().max() < 1e-4  # same model behind both routes
    assert routed.entropy is None and routed.is_top1 is not None  # entropy only if every route gives it
    trainer.train()
    assert math.isfinite(_opd_logs(trainer)[0]["opd/reverse_kl"])


def test_student_with_another_tokenizer_is_refused_at_start_up(teacher_server, prompts, make_config, tmp_path):
    from trl_opd.tiny import build_model, build_tokenizer

    other = build_tokenizer(vocab_size=300)
    build_model(other).save_pretrained(tmp_path / "other")
    other.save_pretrained(tmp_path / "other")
    message = rf"served at {teacher_server} .* tokenizes differently from the student .*teacher_tokenizer_mode: cross"
    with pytest.raises(ValueError, match=message):
        OPDTrainer(model=str(tmp_path / "other"), args=make_config(teacher_server_url=teacher_server),
                   train_dataset=prompts)


@pytest.mark.parametrize("credit", ["byte", "chunk"])
def test_a_served_teacher_of_another_family_scores_like_the_local_one(teacher_server, tiny, tiny_other_teacher,
                                                                       prompts, make_config, credit):
    """teacher_tokenizer_mode cross with a served teacher: a student of another family (its own tokenizer and chat
    template) from the served tiny teacher, whose tokenizer is given by path and checked against the server. By
    byte, the served teacher's extension mass comes from its top 20 entries, the local one's from its whole
    distribution: with this teacher (486 tokens), the logged KL is the same to 1e-4."""
    served = OPDTrainer(
        model=str(tiny_other_teacher), train_dataset=prompts,
        args=make_config(max_steps=1, teacher_server_url=teacher_server, teacher_tokenizer_mode="cross",
                         teacher_tokenizer_name_or_path=str(tiny / "teacher"), teacher_cross_credit=credit),
    )
    served.train()
    assert served.teacher.scorer.topk == (20 if credit == "byte" else 0)  # the entries the byte credit reads
    local = OPDTrainer(model=str(tiny_other_teacher), teacher_model=str(tiny / "teacher"), train_dataset=prompts,
                       args=make_config(max_steps=1, teacher_tokenizer_mode="cross", teacher_cross_credit=credit))
    local.train()
    served_log, local_log = _opd_logs(served)[0], _opd_logs(local)[0]
    assert served_log["opd/reverse_kl"] == pytest.approx(local_log["opd/reverse_kl"], abs=1e-4)
    assert served_log["opd/aligned_chunk_tokens_mean"] == local_log["opd/aligned_chunk_tokens_mean"]
    if credit == "chunk":
        return
    with pytest.raises(ValueError, match="tokenizes differently from the teacher tokenizer .*must be the served"):
        OPDTrainer(model=str(tiny_other_teacher), train_dataset=prompts,
                   args=make_config(teacher_server_url=teacher_server, teacher_tokenizer_mode="cross",
                                    teacher_tokenizer_name_or_path=str(tiny_other_teacher)))


# ------------------------------------------------------------------------------------ faults, from a fake server


@pytest.fixture
def fake_server():
    servers = []

    def make(*answers):
        """A server answering each request with the next canned (status, body), the last one from then on."""
        queue = list(answers)
        servers.append(LoopbackHTTPServer(lambda path, headers, body: queue.pop(0) if len(queue) > 1 else queue[0]))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def _one_sequence():
    prompt_ids, completion_ids = torch.tensor([[5, 6]]), torch.tensor([[7, 8]])
    return prompt_ids, torch.ones_like(prompt_ids), completion_ids, torch.ones_like(completion_ids)


def _answer(prompt_logprobs):
    return 200, {"choices": [{"index": 0, "prompt_logprobs": prompt_logprobs}]}


def test_5xx_is_retried_with_backoff_then_names_the_url_and_status(fake_server):
    server = fake_server((503, {"error": "overloaded"}))
    teacher = VLLMServerTeacher(server.url, max_retries=2, backoff=0.0)
    message = rf"{server.url} did not answer .* after 3 attempts \(last: HTTP 503\)"
    with pytest.raises(TeacherServerError, match=message):
        teacher.score(*_one_sequence())
    assert len(server.requests) == 3


def test_a_transient_5xx_recovers(fake_server):
    good = _answer([None, {"6": {"logprob": -1.0, "rank": 2}}, {"7": {"logprob": -0.5, "rank": 1}},
                    {"8": {"logprob": -2.0, "rank": 3}}])
    server = fake_server((502, {}), good)
    scores = VLLMServerTeacher(server.url, backoff=0.0).score(*_one_sequence())
    assert scores.logps.tolist() == [[-0.5, -2.0]] and scores.is_top1.tolist() == [[True, False]]


def test_unreachable_server_is_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    with pytest.raises(TeacherServerError, match=rf"{url} did not answer .* \(last: ConnectionError\)"):
        VLLMServerTeacher(url, max_retries=1, backoff=0.0).score(*_one_sequence())


@pytest.mark.parametrize(
    "prompt_logprobs, message",
    [
        ([None, {"6": {"logprob": -1.0}}, {"7": {"logprob": -0.5}}], r"sequence 0 came back with 3 .* expected 4"),
        ([None, {"6": {"logprob": -1.0}}, None, {"8": {"logprob": -2.0}}], r"sequence 0, completion position 0"),
        ([None, {"6": {"logprob": -1.0}}, {"7": {"logprob": math.nan}}, {"8": {"logprob": -2.0}}], "log-prob nan"),
        ([None, {"6": {"logprob": -1.0}}, {"7": {"logprob": -0.5}}, {"9": {"logprob": -2.0}}], r"token 8\) has"),
    ],
    ids=["short", "null", "nan", "wrong-token"],
)
def test_malformed_answers_are_rejected_with_the_sequence(fake_server, prompt_logprobs, message):
    server = fake_server(_answer(prompt_logprobs))
    with pytest.raises(TeacherServerError, match=message):
        VLLMServerTeacher(server.url).score(*_one_sequence())


def test_a_compact_answer_of_the_wrong_shape_or_not_finite_is_rejected(fake_server):
    import base64

    def array(values, dtype):
        return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode()

    def answer(lengths, logprobs):
        return 200, {"lengths": lengths, "logprobs": array(logprobs, "<f4"), "ranks": array([1] * len(logprobs), "<i4"),
                     "topk_ids": "", "topk_logprobs": ""}

    for canned, message in [(answer([1], [-0.5]), r"with \[1\] scored positions, expected \[2\]"),
                            (answer([2], [-0.5, math.inf]), "sequence 0, completion position 1 has log-prob inf")]:
        server = fake_server(canned)
        teacher = VLLMServerTeacher(server.url)
        teacher.compact[server.url] = True
        with pytest.raises(TeacherServerError, match=message):
            teacher.score(*_one_sequence())
    server = fake_server(answer([2], [-0.5, -2.0]))
    teacher = VLLMServerTeacher(server.url)
    teacher.compact[server.url] = True
    assert teacher.score(*_one_sequence()).logps.tolist() == [[-0.5, -2.0]]
    assert server.requests[-1][2] == {"sequences": [[5, 6, 7, 8]], "score_from": [2], "topk": 0}


def test_an_answer_with_fewer_than_k_tokens_is_rejected(fake_server):
    server = fake_server(_answer([None, {"6": {"logprob": -1.0}}, {"7": {"logprob": -0.5, "rank": 1}},
                                  {"8": {"logprob": -2.0, "rank": 3}, "3": {"logprob": -0.1, "rank": 1}}]))
    with pytest.raises(TeacherServerError, match=r"position 0: expected the 2 most likely tokens .* got 1"):
        VLLMServerTeacher(server.url, topk=2).score(*_one_sequence())


def test_api_key_is_sent_but_never_shown(fake_server, monkeypatch):
    monkeypatch.setenv("OPD_TEACHER_API_KEY", "sekrit-123")
    server = fake_server((401, {"error": "bad key"}))
    teacher = VLLMServerTeacher.from_env(server.url, api_key_env="OPD_TEACHER_API_KEY", backoff=0.0)
    with pytest.raises(TeacherServerError, match="HTTP 401") as error:
        teacher.score(*_one_sequence())
    assert len(server.requests) == 1  # a 4xx is not retried
    assert server.requests[0][1]["Authorization"] == "Bearer sekrit-123"
    assert "sekrit" not in str(error.value) and "sekrit" not in repr(teacher.__dict__.get("urls"))


def test_serve_teacher_command_has_the_scoring_flags_and_user_flags_win():
    command = vllm_command("m", python="py", host="0.0.0.0", port=9, max_logprobs=20, extra=["--port", "7"])
    assert command[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--no-enable-prefix-caching" in command
    assert command[command.index("--logprobs-mode") + 1] == "raw_logprobs"
    assert command[command.index("--max-logprobs") + 1] == "20"
    assert command.count("--port") == 1 and command[command.index("--port") + 1] == "7"
    # the compact scoring endpoint, from a directory that holds nothing else to shadow the server's imports
    assert command[command.index("--middleware") + 1] == "opd_scoring_route.opd_scoring"
    paths = server_env({"PYTHONPATH": "/elsewhere"})["PYTHONPATH"].split(os.pathsep)
    assert paths == [str(ROUTE_DIR), "/elsewhere"]
    assert sorted(p.name for p in ROUTE_DIR.iterdir() if p.suffix == ".py") == ["opd_scoring_route.py"]
    # room for prompt log-probs outside vLLM's memory profile, unless the user says otherwise
    assert command[command.index("--max-num-batched-tokens") + 1] == "2048"
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.8"
    mine = vllm_command("m", python="py", host="h", port=9, max_logprobs=20,
                        extra=["--gpu-memory-utilization=0.5", "--max-num-batched-tokens", "512"])
    assert mine.count("--max-num-batched-tokens") == 1 and mine[-2:] == ["--max-num-batched-tokens", "512"]
    assert "--gpu-memory-utilization" not in mine and "--gpu-memory-utilization=0.5" in mine


def test_the_server_runs_from_a_wheel_install_with_its_compact_endpoint(teacher_server_process, teacher_server):
    # the session's server is started from a wheel-built install (conftest): the endpoint's module is in the wheel
    route = Path(teacher_server_process.site) / "trl_opd" / "server_route" / "opd_scoring_route.py"
    assert route.is_file()
    assert f"Compact scoring endpoint /opd/score from {route}" in teacher_server_process.log.read_text()
    assert requests.get(teacher_server + "/opd/info", timeout=30).json()["version"] == 1


def test_serve_teacher_refuses_an_install_without_its_scoring_endpoint(tmp_path, monkeypatch, capsys):
    from trl_opd.tools import serve

    monkeypatch.setattr(serve, "ROUTE_DIR", tmp_path)  # an install that lost the module
    with pytest.raises(SystemExit, match="lacks its scoring endpoint .*Reinstall trl_opd"):
        serve.main(["m", "--dry-run"])
    monkeypatch.undo()
    serve.main(["m", "--dry-run", "--host", "0.0.0.0"])
    assert "from other nodes too" in capsys.readouterr().out


# ------------------------------------------------------------------ the real server stopped mid-run (kept last: slow)


class _StopServerAfterStep(TrainerCallback):
    def __init__(self, server, step, restart):
        self.server, self.step, self.restart = server, step, restart

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.server.stop()
            if self.restart:
                self.server.start()  # not ready for about a minute: the next scoring request must retry


def test_server_restarted_within_the_retry_window_loses_no_step(
    teacher_server, teacher_server_process, tiny, prompts, make_config
):
    # backoff 1, 2, 4, ... s: nine retries wait up to 511 s, a restart takes about a minute here
    config = make_config(max_steps=3, teacher_server_url=teacher_server, teacher_server_max_retries=9)
    trainer = OPDTrainer(model=str(tiny / "student"), args=config, train_dataset=prompts)
    trainer.add_callback(_StopServerAfterStep(teacher_server_process, step=1, restart=True))
    trainer.train()
    assert [entry["step"] for entry in _opd_logs(trainer)] == [1, 2, 3]
    assert all(math.isfinite(entry["opd/reverse_kl"]) for entry in _opd_logs(trainer))


def test_server_down_stops_training_and_the_last_checkpoint_resumes(
    teacher_server, teacher_server_process, tiny, prompts, make_config
):
    from pathlib import Path

    from safetensors.torch import load_file

    config = make_config(
        max_steps=3, save_strategy="steps", save_steps=1, teacher_server_url=teacher_server,
        teacher_server_max_retries=1,
    )
    trainer = OPDTrainer(model=str(tiny / "student"), args=config, train_dataset=prompts)
    trainer.add_callback(_StopServerAfterStep(teacher_server_process, step=1, restart=False))
    try:
        with pytest.raises(TeacherServerError, match=rf"{teacher_server} did not answer POST /opd/score"):
            trainer.train()
    finally:
        teacher_server_process.start()

    checkpoints = sorted(p.name for p in Path(config.output_dir).glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-1"]
    saved = load_file(Path(config.output_dir) / "checkpoint-1" / "model.safetensors")
    assert all(torch.equal(saved[name], p) for name, p in trainer.model.state_dict().items())  # intact

    teacher_server_process.wait_ready()
    resumed = OPDTrainer(model=str(tiny / "student"), args=config, train_dataset=prompts)
    resumed.train(resume_from_checkpoint=str(Path(config.output_dir) / "checkpoint-1"))
    assert resumed.state.global_step == 3
    # the history restored from the checkpoint, then the two steps trained after the resume
    assert [entry["step"] for entry in _opd_logs(resumed)] == [1, 2, 3]
    assert _opd_logs(resumed)[0] == _opd_logs(trainer)[0]
