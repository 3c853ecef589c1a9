"""Secrets never written or shown, and bad input refused early with the field or row named."""

import json
import warnings
from pathlib import Path

import pytest

from trl_opd.teachers.vllm_server import TeacherServerError, VLLMServerTeacher
from trl_opd.tools import cli, recipe
from trl_opd.tools.testing import LoopbackHTTPServer, free_port

ROOT = Path(__file__).parents[1]
SMOKE_SERVED = str(ROOT / "recipes" / "smoke_cpu_served.yaml")
PASSWORD = "pw-NeverWriteThis-31"
TOKEN = "hf_alsoNeverWrittenAnywhere42"


def _with_credentials(url: str) -> str:
    return url.replace("http://", f"http://opd-user:{PASSWORD}@")


def _files_containing(directory: Path, *secrets: str) -> list[str]:
    found = []
    for path in directory.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            found += [f"{path.relative_to(directory)}: {secret}" for secret in secrets if secret.encode() in data]
    return found


# ------------------------------------------------------------------------------------------ secrets


def test_url_credentials_and_the_hub_token_are_in_no_file_and_no_message(teacher_server, tiny, tmp_path, capfd,
                                                                         caplog):
    # the server ignores the basic-auth header the client sends from the URL; the run must work and record no secret
    output_dir = tmp_path / "run"
    url = _with_credentials(teacher_server)
    argv = ["--config", SMOKE_SERVED, "--model_name_or_path", str(tiny / "student"), "--teacher_server_url", url,
            "--dataset_name", str(tiny / "train.jsonl"), "--output_dir", str(output_dir), "--max_steps", "2",
            "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "1", "--hub_token", TOKEN,
            "--report_to", "none"]
    with pytest.warns(UserWarning, match="carries credentials .* teacher_server_api_key_env"):
        cli.main(argv)
    assert (output_dir / "checkpoint-2" / "training_args.bin").exists()
    assert _files_containing(output_dir, PASSWORD, TOKEN) == []
    captured = capfd.readouterr()
    assert PASSWORD not in captured.out + captured.err + caplog.text
    assert TOKEN not in captured.out + captured.err + caplog.text
    card = (output_dir / "README.md").read_text()
    assert f"served by vLLM at {teacher_server.replace('http://', 'http://***@')}" in card

    # the saved arguments load, without the secrets; the live config still had them for the run
    import torch

    saved = torch.load(output_dir / "checkpoint-2" / "training_args.bin", weights_only=False)
    assert saved.hub_token is None and saved.teacher_server_url == [teacher_server.replace("http://", "http://***@")]
    assert PASSWORD not in json.dumps(saved.to_dict(), default=str)


def test_a_server_error_never_shows_the_urls_credentials(tokenizer):
    url = _with_credentials(f"http://127.0.0.1:{free_port()}")  # nothing listens here
    teacher = VLLMServerTeacher(url, max_retries=0, backoff=0.0, startup_timeout=0.2)
    with pytest.raises(TeacherServerError, match=r"http://\*\*\*@127\.0\.0\.1:\d+ was not up after 0\.2 s") as error:
        teacher.connect(tokenizer, student_name="s")
    assert PASSWORD not in str(error.value)


def test_waiting_for_a_teacher_server_says_so_every_10_s_until_its_timeout(tiny, tmp_path):
    # the served smoke recipe, as a user runs it, with nothing listening at its server's port: the wait is shown
    import subprocess
    import sys
    import time

    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "trl_opd", "--config", "smoke_cpu_served", "--teacher_server_url", url,
         "--teacher_server_startup_timeout", "12", "--model_name_or_path", str(tiny / "student"),
         "--dataset_name", str(tiny / "train.jsonl"), "--output_dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    waited = time.monotonic() - started
    notes = [line for line in result.stderr.splitlines() if line.startswith("Waiting for the teacher server")]
    assert result.returncode != 0 and f"Teacher server {url} was not up after 12 s" in result.stderr
    assert [note.split(": ")[-1] for note in notes] == ["0 s of at most 12 s (teacher_server_startup_timeout).",
                                                        "10 s of at most 12 s (teacher_server_startup_timeout)."]
    assert all(f"{url} (ConnectionError: nothing answers yet)" in note for note in notes)
    assert 12 <= waited < 60 and not (tmp_path / "out").exists()  # no model loaded or written before it


def test_start_up_waits_for_a_teacher_server_that_is_still_loading(tokenizer):
    # a large teacher refuses connections while its server starts, then answers 503 until the model is loaded:
    # connect waits for it (up to teacher_server_startup_timeout), where a request's own retries give up at once
    import threading
    import time

    port = free_port()
    started = time.monotonic()
    servers = []

    def start_later():
        time.sleep(1.0)
        loading = lambda path, headers, body: (503, {}) if time.monotonic() - started < 3.0 else (200, {"data": []})
        servers.append(LoopbackHTTPServer(loading, port=port))

    threading.Thread(target=start_later, daemon=True).start()
    teacher = VLLMServerTeacher(f"http://127.0.0.1:{port}", max_retries=0, backoff=0.0)
    try:  # past the wait, the first answer after /health is this fake's unusable model list
        with pytest.raises(TeacherServerError, match=r"answered /v1/models with an unexpected shape"):
            teacher.connect(tokenizer, student_name="s")
    finally:
        for server in servers:
            server.close()
    paths = [path for path, *_ in servers[0].requests]
    assert time.monotonic() - started >= 3.0 and paths[-3:] == ["/health", "/health", "/v1/models"]

    with pytest.raises(TeacherServerError, match=r"was not up after 0\.5 s \(last: ConnectionError: .*raise "
                                                 r"teacher_server_startup_timeout"):
        VLLMServerTeacher(f"http://127.0.0.1:{free_port()}", startup_timeout=0.5).connect(tokenizer, student_name="s")


def _one_sequence():
    import torch

    prompt_ids, completion_ids = torch.tensor([[5, 6]]), torch.tensor([[7, 8]])
    return prompt_ids, torch.ones_like(prompt_ids), completion_ids, torch.ones_like(completion_ids)


def _answering(body: bytes) -> LoopbackHTTPServer:
    """A server answering every request with HTTP 200 and `body`, whatever it is (HTML, nonsense JSON)."""
    return LoopbackHTTPServer(lambda path, headers, request: (200, body))


@pytest.mark.parametrize("body, message", [
    (b"<html><body>502 Bad Gateway</body></html>", r"with HTTP 200 but not JSON: '<html>"),
    (b'["not", "an", "object"]', "with list JSON, expected an object"),
    (b'{"choices": "nonsense"}', r"answered /v1/completions with an unexpected shape"),
    (b'{"choices": [{"index": 0, "prompt_logprobs": "x"}]}', "not a list of per-position"),
    (b'{"choices": [{"index": 0, "prompt_logprobs": [null, {}, {"7": {"logprob": "-0.5"}}, {}]}]}',
     r"token 7\) has log-prob '-0.5': expected a finite number"),
    (b'{"choices": [{"index": 0, "prompt_logprobs": [null, {}, {"7": {"logprob": -0.5}, "tok": 1}, '
     b'{"8": {"logprob": -1.0}}]}]}', "top tokens are not token ids with numeric log-probs"),
], ids=["html", "list", "choices", "entries", "string-logprob", "top-entries"])
def test_a_malformed_answer_is_an_error_naming_the_server(body, message):
    with _answering(body) as server, pytest.raises(TeacherServerError, match=message) as error:
        VLLMServerTeacher(server.url, topk=1 if b"tok" in body else 0).score(*_one_sequence())
    assert server.url in str(error.value)


def test_a_malformed_models_answer_at_start_up_names_the_server(tokenizer):
    with _answering(b'{"data": []}') as server, pytest.raises(
            TeacherServerError, match=r"answered /v1/models with an unexpected shape \(IndexError"):
        VLLMServerTeacher(server.url).connect(tokenizer, student_name="s")


def test_push_errors_mask_a_token_from_the_environment(tiny, tmp_path, monkeypatch, capfd):
    import huggingface_hub.constants
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # a Hub endpoint that refuses every request and echoes the token it was sent, as a careless proxy would
    hub = LoopbackHTTPServer(lambda path, headers, body: (401, {"error": f"token {headers.get('Authorization')} "
                                                                          "is not valid"}))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # the token comes from the environment, not from an argument
    model_dir = tmp_path / "model"
    AutoModelForCausalLM.from_pretrained(tiny / "student").save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(tiny / "student").save_pretrained(model_dir)
    try:
        with pytest.raises(SystemExit, match=r"(?s)Could not push .* \(.*401.*Bearer \*\*\* is not valid") as error:
            cli.main(["push", str(model_dir), "--repo-id", "me/x"])
    finally:
        hub.close()
    captured = capfd.readouterr()
    assert TOKEN not in str(error.value) + captured.out + captured.err


def test_a_teachers_value_that_is_not_a_mapping_is_refused_at_parse_time(tmp_path):
    common = ["--model_name_or_path", "m", "--output_dir", str(tmp_path), "--bf16", "false"]
    with pytest.raises(ValueError, match=r"teachers must be a mapping .* got str '\[\"a\", \"b\"\]'"):
        recipe.make_parser().parse_args_and_config([*common, "--teachers", '["a", "b"]'])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recipe.make_parser().parse_args_and_config([*common, "--teacher_server_url", "http://127.0.0.1:9"])
    assert not [w for w in caught if "credentials" in str(w.message)]  # a plain URL warns about nothing


# ------------------------------------------------------------------------------------------ lost, mixed or wrong data


def test_a_used_output_dir_is_refused_unless_resuming_or_overwriting(tiny, prompts, make_config, tmp_path):
    from trl_opd import OPDTrainer

    output_dir = tmp_path / "out"
    for step in (1, 2, 3, 7):  # an old run's checkpoints, one beyond what the new run will write
        (output_dir / f"checkpoint-{step}").mkdir(parents=True)
        (output_dir / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))

    def trainer(**overrides):
        config = make_config(**{"output_dir": str(output_dir), "max_steps": 2, "save_strategy": "steps",
                                "save_steps": 1, **overrides})
        return OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=config,
                          train_dataset=prompts)

    with pytest.raises(FileExistsError, match=r"already holds files \(checkpoint-1, .*checkpoint-7\).*"
                                              r"resume_from_checkpoint: true.*overwrite_output_dir: true"):
        trainer().train()
    assert sorted(p.name for p in output_dir.iterdir()) == ["checkpoint-1", "checkpoint-2", "checkpoint-3",
                                                             "checkpoint-7"]  # untouched

    trainer(overwrite_output_dir=True).train()
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    # a resume now continues this run, not the old run's checkpoint-7
    resumed = trainer(max_steps=3)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3


def test_a_new_run_logging_completions_claims_its_own_output_dir_and_still_refuses_another_runs(
        tiny, prompts, make_config, tmp_path):
    from trl_opd import OPDTrainer

    def trainer(output_dir):  # GRPO's constructor makes output_dir/completions for the completion tables
        config = make_config(output_dir=str(output_dir), max_steps=2, log_completions=True, save_strategy="steps",
                             save_steps=2)
        return OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=config,
                          train_dataset=prompts)

    fresh = tmp_path / "fresh"
    run = trainer(fresh)
    assert sorted(p.name for p in fresh.iterdir()) == ["completions"]
    run.train()
    assert run.state.global_step == 2
    assert sorted(p.name for p in (fresh / "completions").iterdir()) == ["completions_00001.parquet",
                                                                        "completions_00002.parquet"]

    # the finished run's directory, or one holding only another run's completion tables, is another run's
    finished = r"already holds files \(README.md, checkpoint-2, completions, opd_training.json\)"
    with pytest.raises(FileExistsError, match=finished):
        trainer(fresh).train()
    tables_only = tmp_path / "tables_only"
    (tables_only / "completions").mkdir(parents=True)
    (tables_only / "completions" / "completions_00001.parquet").write_bytes(b"another run's table")
    with pytest.raises(FileExistsError, match=r"already holds files \(completions\)"):
        trainer(tables_only).train()
    assert [p.name for p in (tables_only / "completions").iterdir()] == ["completions_00001.parquet"]  # untouched


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_evaluation_on_the_training_file_is_refused_before_anything_loads(tmp_path):
    data = _jsonl(tmp_path / "train.jsonl", [{"prompt": "a"}])
    for extra in ([], ["--eval_dataset_name", str(tmp_path / "." / "train.jsonl")]):
        argv = ["--model_name_or_path", str(tmp_path / "no-model-needed"), "--dataset_name", data, "--bf16", "false",
                "--output_dir", str(tmp_path / "out"), "--eval_strategy", "steps", *extra]
        script_args, training_args, model_args = recipe.make_parser().parse_args_and_config(argv)
        with pytest.raises(ValueError, match=r"Evaluation would read the training prompts: .* eval_dataset_name"):
            recipe.check_held_out(script_args)
    script_args.eval_dataset_name = _jsonl(tmp_path / "heldout.jsonl", [{"prompt": "b"}])
    recipe.check_held_out(script_args)  # a separate file is fine


def test_the_teachers_prompt_column_is_built_by_the_students_rules(tmp_path):
    data = _jsonl(tmp_path / "q.jsonl", [{"prompt": "What is 2 plus 2?", "hinted": "Hint: 4. What is 2 plus 2?"}])
    wrapped = recipe.load_prompts(recipe.OPDScriptArguments(dataset_name=data, prompt_as_user_message=True,
                                                      system_prompt="Be brief."),
                               "train", teacher_prompt_column="hinted")[0]
    system = {"role": "system", "content": "Be brief."}
    assert wrapped["prompt"] == [system, {"role": "user", "content": "What is 2 plus 2?"}]
    assert wrapped["hinted"] == [system, {"role": "user", "content": "Hint: 4. What is 2 plus 2?"}]

    # chat prompts and no wrapping: the system prompt still goes to both, never silently dropped
    chat = _jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "Hi"}],
                                             "hinted": [{"role": "user", "content": "Hint. Hi"}]}])
    row = recipe.load_prompts(recipe.OPDScriptArguments(dataset_name=chat, system_prompt="Be brief."), "train",
                           teacher_prompt_column="hinted")[0]
    assert row["prompt"] == [system, {"role": "user", "content": "Hi"}]
    assert row["hinted"] == [system, {"role": "user", "content": "Hint. Hi"}]
    with pytest.raises(ValueError, match=r"system_prompt goes in front of chat prompts, but the 'prompt' column"):
        recipe.load_prompts(recipe.OPDScriptArguments(dataset_name=data, system_prompt="Be brief."), "train")


# ------------------------------------------------------------------------------------------ late or unnamed failures


@pytest.mark.parametrize("extra, message", [
    (["--opd_coef", "nan"], "opd_coef must be a finite number, got nan"),
    (["--opd_dense_coef", "inf"], "opd_dense_coef must be a finite number, got inf"),
    (["--max_steps", "0"], r"Nothing to train: max_steps=0"),
    (["--max_completion_length", "0"], "max_completion_length must be at least 1 token"),
    (["--teacher_server_timeout", "0"], "teacher_server_timeout must be positive"),
    (["--teacher_server_max_retries", "-1"], "teacher_server_max_retries must be 0 or more"),
    (["--teacher_server_url", "127.0.0.1:8000"], r"looks like a server address without its scheme: write "
                                                 r"'http://127.0.0.1:8000'"),
    (["--teacher_server_url", "ftp://10.0.0.7:8000"], "uses the scheme 'ftp': teacher servers are reached over http"),
    (["--teachers", '{"math": "localhost:8000"}'], r"teachers\['math'\] 'localhost:8000' looks like a server address"),
], ids=["nan-coef", "inf-coef", "max-steps-0", "no-tokens", "timeout-0", "retries", "no-scheme", "ftp", "routed"])
def test_bad_settings_are_refused_at_parse_time_naming_the_field(tmp_path, extra, message):
    argv = ["--model_name_or_path", "m", "--output_dir", str(tmp_path), "--bf16", "false", *extra]
    with pytest.raises(ValueError, match=message):
        recipe.make_parser().parse_args_and_config(argv)


def test_a_non_finite_loss_stops_training_before_that_step_is_saved(tiny, prompts, make_config, tmp_path):
    from trl_opd import OPDTrainer

    config = make_config(max_steps=3, save_strategy="steps", save_steps=1)
    trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=config,
                         train_dataset=prompts)
    compute = trainer._compute_loss

    def poisoned(model, inputs):  # a fault injected at step 2: the loss turns NaN
        loss = compute(model, inputs)
        return loss * float("nan") if trainer.state.global_step == 1 else loss

    trainer._compute_loss = poisoned
    # the Trainer leaves a NaN loss out of its running loss (logging_nan_inf_filter); the gradient norm shows it
    with pytest.raises(FloatingPointError, match=r"Step 2: the gradient norm is not finite; training stopped befo"):
        trainer.train()
    saved = sorted(p.name for p in Path(config.output_dir).glob("checkpoint-*"))
    assert saved == ["checkpoint-1"]


def test_opd_topk_beyond_the_vocabulary_is_refused_before_training(tiny, prompts, make_config):
    from trl_opd import OPDTrainer

    with pytest.raises(ValueError, match=r"opd_topk=100000 exceeds the student's vocabulary of \d+ tokens"):
        OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), train_dataset=prompts,
                   args=make_config(opd_estimator="topk", opd_topk=100_000))


def test_check_runs_on_a_recipe_with_routed_teachers(tiny, tmp_path, capsys):
    rows = [json.loads(line) for line in (tiny / "train.jsonl").read_text().splitlines()][:8]
    data = _jsonl(tmp_path / "routed.jsonl", [{"prompt": r["prompt"], "teacher": ["a", "b"][i % 2]}
                                              for i, r in enumerate(rows)])
    teachers = json.dumps({"a": str(tiny / "teacher"), "b": str(tiny / "student")})
    argv = ["check", "--config", str(ROOT / "recipes" / "smoke_cpu.yaml"), "--model_name_or_path",
            str(tiny / "student"), "--teacher_model_name_or_path", "", "--teachers", teachers, "--dataset_name", data,
            "--output_dir", str(tmp_path / "unused"), "--per_device_train_batch_size", "8"]
    with pytest.raises(SystemExit) as exit_code:
        cli.main(argv)
    assert exit_code.value.code == 0
    assert "reference as teacher: opd/reverse_kl = 0.0000" in capsys.readouterr().out


def test_the_cpu_process_group_keeps_a_recipes_accelerator_config(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text('model_name_or_path: m\naccelerator_config: {"split_batches": true, "even_batches": false}\n')
    argv = cli._with_configured_state(["--config", str(recipe)])
    assert json.loads(argv[-1]) == {"split_batches": True, "even_batches": False, "use_configured_state": True}
    override = cli._with_configured_state(["--config", str(recipe), "--accelerator_config", '{"even_batches": true}'])
    assert json.loads(override[-1]) == {"even_batches": True, "use_configured_state": True}


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "What is 2 plus 2?"}, {"prompt": "  "}], r"train_dataset row 1: its 'prompt' is an empty string"),
    ([{"prompt": "What is 2 plus 2?"}, {"prompt": None}], r"train_dataset row 1: its 'prompt' is NoneType"),
    ([{"prompt": 3}], r"train_dataset row 0: its 'prompt' is int '3'"),
    ([{"prompt": [{"role": "user", "content": "Hi"}]}, {"prompt": []}], r"row 1: its 'prompt' is an empty list"),
    ([{"prompt": [{"text": "Hi"}]}], r"row 0: its 'prompt' message 0 is not a dict with 'role' and 'content'"),
], ids=["empty-string", "null", "int", "no-messages", "not-a-message"])
def test_bad_prompts_are_refused_before_anything_loads_naming_the_row(tmp_path, make_config, rows, message):
    from datasets import Dataset

    from trl_opd import OPDTrainer

    with pytest.raises(ValueError, match=message):  # paths that do not exist: the check must come first
        OPDTrainer(model=str(tmp_path / "no-student"), teacher_model=str(tmp_path / "no-teacher"),
                   args=make_config(), train_dataset=Dataset.from_list(rows))


def test_an_empty_prompt_file_is_refused_by_name(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    argv = ["--model_name_or_path", "m", "--output_dir", str(tmp_path / "out"), "--bf16", "false",
            "--dataset_name", str(empty), "--prompt_as_user_message", "true", "--system_prompt", "Be brief."]
    script_args, training_args, model_args = recipe.make_parser().parse_args_and_config(argv)
    with pytest.raises(ValueError, match=r"Dataset file '.*empty.jsonl' is empty: there are no prompts in it"):
        recipe.load_prompts(script_args, "train")


def test_serve_teacher_without_vllm_says_what_to_install_before_claiming_to_serve(tmp_path, capsys):
    import sys

    # this test interpreter has no vllm (the server runs in its own virtualenv)
    with pytest.raises(SystemExit, match=r"cannot import vllm, so it cannot serve the teacher. Install it there"):
        cli.main(["serve-teacher", str(tmp_path / "teacher"), "--python", sys.executable])
    assert "Teacher will serve at" not in capsys.readouterr().out


def test_the_completion_token_total_continues_across_a_resume(tiny, prompts, make_config):
    from trl_opd import OPDTrainer

    def run(resume=None):
        config = make_config(max_steps=4, save_strategy="steps", save_steps=2)
        trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=config,
                             train_dataset=prompts)
        trainer.train(resume_from_checkpoint=resume)
        return {e["step"]: e["data/completion_tokens_total"] for e in trainer.state.log_history
                if "data/completion_tokens_total" in e}

    uninterrupted = run()
    resumed = run(resume=str(Path(make_config().output_dir) / "checkpoint-2"))  # steps 3 and 4 again
    assert list(uninterrupted) == [1, 2, 3, 4] and uninterrupted[4] > uninterrupted[3] > uninterrupted[2] > 0
    assert (resumed[3], resumed[4]) == (uninterrupted[3], uninterrupted[4])


def test_held_out_kl_ends_each_completion_at_any_stop_id_as_training_does(tiny, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from trl_opd.evaluation import heldout_reverse_kl

    # the tiny teacher samples: its greedy answers differ from prompt to prompt (the tiny student's do not)
    student = AutoModelForCausalLM.from_pretrained(tiny / "teacher")
    teacher = AutoModelForCausalLM.from_pretrained(tiny / "student")
    rows = [json.loads(line) for line in (tiny / "heldout.jsonl").read_text().splitlines()]
    prompts = [rows[0]["prompt"], rows[1]["prompt"]]

    def greedy(prompt, max_new_tokens=16):
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        return student.generate(ids, do_sample=False, max_new_tokens=max_new_tokens,
                                pad_token_id=tokenizer.pad_token_id)[0, ids.size(1):].tolist()

    first, second = greedy(prompts[0]), greedy(prompts[1])
    # a second stop id (as chat models have): the first token of prompt 0's completion that prompt 1's never holds
    position, stop = next((i, t) for i, t in enumerate(first) if t not in second and t != tokenizer.eos_token_id)
    student.generation_config.eos_token_id = [tokenizer.eos_token_id, stop]
    expected = position + 1 + len(greedy(prompts[1]))  # prompt 0 stops at `stop`; prompt 1 as generate ends it
    metrics = heldout_reverse_kl(student, teacher, tokenizer, prompts, max_new_tokens=16, temperature=1e-3)
    assert metrics["tokens"] == expected
    assert torch.isfinite(torch.tensor(metrics["reverse_kl_exact"]))


def test_a_server_reading_a_chat_marker_as_other_ids_is_refused_at_start_up(tokenizer):
    # <|im_start|> is neither bos nor eos: a server whose tokenizer lacks it (another model family's template) splits it
    def vllm(path, headers, body):  # just enough of vLLM's API for the start-up check
        if path == "/v1/models":
            return 200, {"data": [{"id": "fake", "max_model_len": 4096}]}
        if path == "/tokenize":
            text = body["prompt"]
            tokens = [60, 61, 62] if text == "<|im_start|>" else tokenizer(text, add_special_tokens=False)["input_ids"]
            return 200, {"tokens": tokens}
        return (200, {}) if path == "/health" else (500, {})

    with LoopbackHTTPServer(vllm) as server, pytest.raises(
            ValueError, match=r"does not read the student's special token '<\|im_start\|>' as id 1 "
                              r"\(it reads \[60, 61, 62\]\)"):
        VLLMServerTeacher(server.url, max_retries=0).connect(tokenizer, student_name="student")


def test_damaged_weight_files_are_named_before_loading(tiny, prompts, make_config, tmp_path):
    import shutil

    from trl_opd import OPDTrainer

    for damage, message in ((lambda f: f.write_bytes(b""), "is 0 bytes long"),
                            (lambda f: f.write_bytes(f.read_bytes()[:-1000]), "is truncated")):
        teacher = tmp_path / "teacher"
        shutil.rmtree(teacher, ignore_errors=True)
        shutil.copytree(tiny / "teacher", teacher)
        damage(teacher / "model.safetensors")
        with pytest.raises(ValueError, match=rf"The teacher weight file .*model.safetensors {message}"):
            OPDTrainer(model=str(tiny / "student"), teacher_model=str(teacher), args=make_config(),
                       train_dataset=prompts)


def test_a_damaged_newest_checkpoint_names_the_file_and_the_previous_complete_one(tiny, prompts, make_config):
    from trl_opd import OPDTrainer

    config = make_config(max_steps=2, save_strategy="steps", save_steps=1)
    OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=config,
               train_dataset=prompts).train()
    newest = Path(config.output_dir) / "checkpoint-2" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])
    resumed = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"),
                         args=make_config(max_steps=3), train_dataset=prompts)
    with pytest.raises(ValueError, match=r"checkpoint-2/model.safetensors .* the newest complete one before it is "
                                         r".*checkpoint-1"):
        resumed.train(resume_from_checkpoint=True)


def test_chat_prompts_for_a_student_without_a_chat_template_are_refused_at_start_up(tiny, prompts, make_config,
                                                                                          tmp_path):
    import shutil

    from trl_opd import OPDTrainer

    student = tmp_path / "base-student"
    shutil.copytree(tiny / "student", student)
    config_file = student / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    tokenizer_config.pop("chat_template", None)
    config_file.write_text(json.dumps(tokenizer_config))
    (student / "chat_template.jinja").unlink(missing_ok=True)
    student_tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(student)
    with pytest.raises(ValueError, match=r"prompts are chat messages, but the student's tokenizer .* has no chat "
                                         r"template"):
        OPDTrainer(model=str(student), teacher_model=str(tiny / "teacher"), args=make_config(),
                   train_dataset=prompts, processing_class=student_tokenizer)


def test_resuming_with_another_lora_rank_names_the_field(tiny, prompts, make_config):
    from peft import LoraConfig

    from trl_opd import OPDTrainer

    def trainer(rank, **overrides):
        return OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), train_dataset=prompts,
                          args=make_config(save_strategy="steps", save_steps=1, **overrides),
                          peft_config=LoraConfig(r=rank, lora_alpha=8, target_modules="all-linear"))

    trainer(4, max_steps=1).train()
    with pytest.raises(ValueError, match=r"checkpoint-1 was trained with lora_r=4 \(adapter_config.json\), this run "
                                         r"has 8: resume with the same lora_r"):
        trainer(8, max_steps=2).train(resume_from_checkpoint=True)
    trainer(4, max_steps=2).train(resume_from_checkpoint=True)  # the same settings resume


def test_held_out_accuracy_skips_samples_the_function_cannot_judge_as_training_does(tiny, tokenizer):
    from transformers import AutoModelForCausalLM

    from trl_opd.evaluation import heldout_reverse_kl

    model = AutoModelForCausalLM.from_pretrained(tiny / "student")
    rows = [json.loads(line) for line in (tiny / "heldout.jsonl").read_text().splitlines()][:2]

    def judge(completions, **kwargs):  # cannot judge the first sample, the second is right
        return [None, 1.0]

    metrics = heldout_reverse_kl(model, model, tokenizer, [r["prompt"] for r in rows], max_new_tokens=4,
                                 solutions=[r["answer"] for r in rows], accuracy_func=judge)
    assert metrics["accuracy"] == 1.0  # training's nanmean; counting None as wrong gave 0.5


@pytest.mark.parametrize("overrides, message", [
    (dict(opd_estimator="sampled", opd_dense_coef=0.5),
     r"opd_dense_coef=0.5 weighs the dense term .* opd_estimator='sampled' has none"),
    (dict(opd_estimator="full", opd_topk=5), r"opd_topk=5 is the k of opd_estimator='topk', and this run uses 'full'"),
], ids=["dense-coef-with-sampled", "topk-with-full"])
def test_an_option_the_estimator_ignores_is_refused(tiny, prompts, make_config, overrides, message):
    from trl_opd import OPDTrainer

    with pytest.raises(ValueError, match=message):
        OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), train_dataset=prompts,
                   args=make_config(**overrides))
