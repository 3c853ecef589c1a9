"""Shared fixtures: one tiny student/teacher pair per session, built locally (no model hub)."""

import os
import platform

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The golden traces were recorded on torch's AVX2 kernels. Where the CPU has AVX-512, torch dispatches to wider
# kernels that round differently, and the first step already samples other tokens: every trace differs although the
# code does not. Every x86-64 CPU of this kind has AVX2, so the suite, and every process it starts (DeepSpeed ranks,
# the vLLM server), runs on those kernels wherever it runs. Set before torch is first imported.
if platform.machine() in ("x86_64", "AMD64"):
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Paths of the tiny pair: `tiny / "student"`, `tiny / "teacher"`, `tiny / "train.jsonl"`, ..."""
    from trl_opd.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_agent(tmp_path_factory):
    """The tiny tool-using pair of the arithmetic tool task (`tiny_agent / "student"`, ...); a shorter-trained
    teacher than `trl-opd make-tiny-agent` builds, which is enough to call the tools in the right format."""
    from trl_opd.envs import make_tiny_agent

    return make_tiny_agent(tmp_path_factory.mktemp("tiny_agent"), teacher_steps=300)


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory):
    """The offline addition task with its teacher/student pair, as `trl-opd make-tiny-task` builds it (about a
    minute and a half): the demo's task, so its accuracy gap is tested as shipped."""
    from trl_opd.envs.addition import make_tiny_task

    return make_tiny_task(tmp_path_factory.mktemp("tiny_task"))


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
            activation_checkpointing=False,
            seed=0,
            opd_estimator="sampled",  # the tests of the other estimators ask for them
        )
        return OPDConfig(**{**defaults, **overrides})

    return make


# ------------------------------------------------------------------------------------------ a real vLLM teacher server

SERVER_FIXTURE = "teacher_server"


@pytest.fixture(scope="session")
def teacher_server_process(tiny, tmp_path_factory):
    """The session's vLLM server process (started, maybe not ready yet). Tests that stop it must restart it."""
    from pathlib import Path

    from trl_opd.tools.testing import TeacherServerProcess, install_wheel

    python = os.environ.get("OPD_VLLM_PYTHON", str(Path(__file__).parents[1] / ".venv-vllm" / "bin" / "python"))
    if not Path(python).exists():
        pytest.fail(f"No vLLM interpreter at {python}: run `make test` (it builds .venv-vllm) or set OPD_VLLM_PYTHON.")
    # started from a wheel-built install of this project, as a user's `pip install trl_opd` gives it
    site = install_wheel(Path(__file__).parents[1], tmp_path_factory.mktemp("wheel"))
    server = TeacherServerProcess(tiny / "teacher", tmp_path_factory.mktemp("vllm") / "server.log", python, site=site)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def hidden_server_process(tiny, tmp_path_factory):
    """A second server of the tiny teacher, `serve-teacher --hidden-states`: it returns final hidden states."""
    from pathlib import Path

    from trl_opd.tools.testing import TeacherServerProcess

    python = os.environ.get("OPD_VLLM_PYTHON", str(Path(__file__).parents[1] / ".venv-vllm" / "bin" / "python"))
    server = TeacherServerProcess(tiny / "teacher", tmp_path_factory.mktemp("vllm_hidden") / "server.log", python,
                                  extra=("--hidden-states",))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session", autouse=True)
def _boot_teacher_server_early(request):
    """The servers take a minute to start: launch them with the session, so they boot while other tests run."""
    for fixture, process in ((SERVER_FIXTURE, "teacher_server_process"), ("hidden_server", "hidden_server_process")):
        if any(fixture in getattr(item, "fixturenames", ()) for item in request.session.items):
            request.getfixturevalue(process)


@pytest.fixture
def teacher_server(teacher_server_process):
    """The URL of a ready, warmed-up vLLM server serving the tiny teacher."""
    try:
        teacher_server_process.wait_ready()
    except RuntimeError as error:
        pytest.fail(str(error))
    return teacher_server_process.url


@pytest.fixture
def hidden_server(hidden_server_process):
    """The URL of a ready vLLM server returning the tiny teacher's hidden states."""
    try:
        hidden_server_process.wait_ready()
    except RuntimeError as error:
        pytest.fail(str(error))
    return hidden_server_process.url


@pytest.fixture(scope="session")
def tiny_other_teacher(tmp_path_factory):
    """A teacher of another model family for the tiny pair: its own tokenizer and chat template (a few seconds)."""
    from trl_opd.tiny import make_tiny_other_teacher

    return make_tiny_other_teacher(tmp_path_factory.mktemp("tiny_other_teacher"))


# ------------------------------------------------------------------------------------------------------ the two tiers

# `pytest -m "not slow"` (docs/development.md) leaves these out: a test that needs a vLLM server, an environment
# server, several processes, the real models, or a task that takes a minute or more to build, and any test marked
# `slow` by hand
SLOW_FIXTURES = {"teacher_server", "hidden_server", "teacher_server_process", "hidden_server_process", "env_server",
                 "tiny_task", "tiny_agent"}
SLOW_MODULES = {"test_colocate", "test_distributed", "test_env_server", "test_fsdp2", "test_golden",
                "test_persistence", "test_real_models"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or item.module.__name__ in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
