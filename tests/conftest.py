"""Shared fixtures: one tiny student/teacher pair per session, built locally (no model hub)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Paths of the tiny pair: `tiny / "student"`, `tiny / "teacher"`, `tiny / "train.jsonl"`, ..."""
    from trl_opd.testing import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny / "student")


@pytest.fixture(scope="session")
def prompts(tiny):
    from datasets import load_dataset

    return load_dataset("json", data_files=str(tiny / "train.jsonl"), split="train")


@pytest.fixture
def make_config(tmp_path):
    """An OPDConfig sized for a CPU test: a few short completions per step, everything logged."""

    def make(**overrides):
        from trl_opd import OPDConfig

        defaults = dict(
            output_dir=str(tmp_path / "out"),
            per_device_train_batch_size=4,
            num_generations=1,
            max_completion_length=8,
            learning_rate=1e-3,
            max_steps=2,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            bf16=False,
            gradient_checkpointing=False,
            seed=0,
        )
        return OPDConfig(**{**defaults, **overrides})

    return make


# ------------------------------------------------------------------------------------------ a real vLLM teacher server

SERVER_FIXTURE = "teacher_server"


@pytest.fixture(scope="session")
def _teacher_server_process(tiny, tmp_path_factory):
    """`trl-opd serve-teacher` on the tiny teacher, in vLLM's own virtualenv (`make test` builds it)."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from trl_opd.testing import free_port

    python = os.environ.get("OPD_VLLM_PYTHON", str(Path(__file__).parents[1] / ".venv-vllm" / "bin" / "python"))
    if not Path(python).exists():
        pytest.fail(f"No vLLM interpreter at {python}: run `make test` (it builds .venv-vllm) or set OPD_VLLM_PYTHON.")
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "trl_opd", "serve-teacher", str(tiny / "teacher"), "--python", python,
               "--port", str(port), "--dtype", "float32", "--max-model-len", "512", "--enforce-eager"]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield process, f"http://127.0.0.1:{port}", log
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="session", autouse=True)
def _boot_teacher_server_early(request):
    """The server takes a minute to start: launch it with the session, so it boots while other tests run."""
    if any(SERVER_FIXTURE in getattr(item, "fixturenames", ()) for item in request.session.items):
        request.getfixturevalue("_teacher_server_process")


@pytest.fixture(scope="session")
def teacher_server(_teacher_server_process):
    """The URL of a ready, warmed-up vLLM server serving the tiny teacher."""
    import time

    import requests

    process, url, log = _teacher_server_process
    deadline = time.monotonic() + 600
    while True:
        if process.poll() is not None:
            pytest.fail(f"The vLLM server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"The vLLM server did not become healthy in 600 s:\n{log.read_text()[-3000:]}")
        time.sleep(2)
    model = requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    warm_up = {"model": model, "prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": 0}
    requests.post(url + "/v1/completions", json=warm_up, timeout=300).raise_for_status()
    return url
