"""The code tool environment server (trl_opd/envs/code_env): its sandbox, tried and broken into, its episodes, its
wire protocol, and the GRPO client, against one real server process started for the session.

The server runs with small limits so that the limit tests are quick: 2 s wall, 1 s CPU, 256 MiB, 1 MiB files, 4 turns.
"""

import ast
import errno
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from textwrap import dedent

import pytest

ROOT = Path(__file__).parents[1]
WALL_S, CPU_S, MEMORY_MB, FILE_MB, MAX_TURNS, MAX_OUTPUT = 2, 1, 256, 1, 4, 1024

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root (see trl_opd/envs/code_env)")


class EnvServerProcess:
    """`python -m trl_opd.envs.code_env.server` on a free loopback port: start, wait for /health, stop its group."""

    def __init__(self, log: Path):
        from trl_opd.testing import free_port

        self.log, self.port = log, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = None

    def start(self) -> None:
        command = [sys.executable, "-m", "trl_opd.envs.code_env.server", "--host", "127.0.0.1", "--port",
                   str(self.port), "--wall-time", str(WALL_S), "--cpu-time", str(CPU_S), "--memory-mb",
                   str(MEMORY_MB), "--file-mb", str(FILE_MB), "--max-turns", str(MAX_TURNS), "--max-output",
                   str(MAX_OUTPUT)]
        with open(self.log, "a") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                            start_new_session=True)

    def wait_ready(self, timeout: float = 180) -> None:
        import requests

        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"The environment server exited ({self.process.returncode}):\n"
                                   f"{self.log.read_text()[-3000:]}")
            try:
                if requests.get(self.url + "/health", timeout=5).json() == {"status": "healthy"}:
                    return
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"The environment server was not healthy after {timeout} s")
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop the server's whole process group and wait until it is gone."""
        from trl_opd.testing import stop_process_group

        stop_process_group(self.process, timeout=15)


@pytest.fixture(scope="session")
def env_server(tmp_path_factory):
    server = EnvServerProcess(tmp_path_factory.mktemp("env_server") / "server.log")
    server.start()  # it boots while this process imports the client
    try:
        try:
            server.wait_ready()
        except RuntimeError as error:
            pytest.fail(str(error))
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def session(env_server):
    """One WebSocket session (one server-side environment) through OpenEnv's client."""
    from trl_opd.envs.code_env.client import CodeToolEnvClient

    client = CodeToolEnvClient(env_server.url).sync()
    client.connect()
    yield client
    client.close()


def call(session, tool="run_python", **arguments):
    from trl_opd.envs.code_env.models import ToolCall

    return session.step(ToolCall(tool=tool, arguments=arguments)).observation


def run(session, code: str):
    """`code` run as the first call of a fresh episode: (the observation, seconds the call took)."""
    session.reset()
    start = time.monotonic()
    observation = call(session, code=code)
    return observation, time.monotonic() - start


def sandbox_processes() -> list[str]:
    """Host processes running as a sandbox uid (200000 and up), as "pid name"."""
    from trl_opd.envs.code_env.sandbox import UID_BASE

    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:  # the process ended while being read
            continue
        if UID_BASE <= int(fields["Uid"].split()[0]) < UID_BASE + 1000:
            found.append(f"{status.parent.name} {fields['Name'].strip()}")
    return found


# ------------------------------------------------------------------------------------------ what a snippet returns


def test_a_snippets_output_is_returned_exactly(session):
    observation, _ = run(session, "print('héllo →')\nprint(1 + 2)")
    assert (observation.output, observation.exit_code, observation.error) == ("héllo →\n3\n", 0, None)
    assert not observation.truncated and not observation.timed_out and observation.turn == 1
    observation, _ = run(session, "import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)")
    assert (observation.output, observation.exit_code) == ("out\nerr\n[exit code 3]", 3)


def test_output_is_truncated_at_the_documented_length(session):
    from trl_opd.envs.code_env.environment import TRUNCATED

    observation, _ = run(session, "print('x' * 5000, end='')")
    assert observation.output == "x" * MAX_OUTPUT + "\n" + TRUNCATED.format(limit=MAX_OUTPUT)
    assert observation.truncated and observation.exit_code == 0
    observation, _ = run(session, "import sys\nsys.stdout.write('y' * 10**7)")  # 10 MB: kept bounded on the server
    assert observation.output == "y" * MAX_OUTPUT + "\n" + TRUNCATED.format(limit=MAX_OUTPUT)


# -------------------------------------------------------------------------------------- trying to break the sandbox


def test_the_snippet_runs_unprivileged_in_a_root_of_its_own(session):
    from trl_opd.envs.code_env.sandbox import UID_BASE

    code = ("import os\nprint(os.getuid(), os.getgid(), os.getcwd())\nprint(sorted(os.listdir('/')))\n"
            "try:\n    os.setuid(0)\nexcept PermissionError:\n    print('setuid refused')")
    observation, _ = run(session, code)
    ids, listing, setuid = observation.output.splitlines()
    uid, gid, cwd = ids.split()
    assert int(uid) == int(gid) and UID_BASE <= int(uid) < UID_BASE + 64 and cwd == "/scratch"
    root = set(ast.literal_eval(listing))
    assert {"scratch", "usr", "dev"} <= root and not root & {"etc", "tmp", "proc", "sys", "home", "work", "var"}
    assert setuid == "setuid refused"


def test_reading_outside_the_scratch_directory_fails(session):
    targets = ["/etc/passwd", str(ROOT / "pyproject.toml"), str(Path(__file__).resolve()), "/proc/self/environ",
               "/sys/kernel/hostname"]
    observation, _ = run(session, dedent(f"""
        for path in {targets!r}:
            try:
                print('READ', open(path).read()[:20])
            except OSError as error:
                print(type(error).__name__)"""))
    assert observation.output.splitlines() == ["FileNotFoundError"] * len(targets)


def test_writing_outside_the_scratch_directory_fails(session):
    name = f"opd-sandbox-escape-{uuid.uuid4().hex}"
    targets = [f"/tmp/{name}", f"/{name}", f"/usr/lib/{name}", f"{os.path.realpath(sys.base_prefix)}/{name}",
               f"/scratch/../{name}", f"/dev/{name}"]
    observation, _ = run(session, dedent(f"""
        import errno, os
        for path in {targets!r}:
            try:
                open(path, 'w').write('x')
                print('WROTE', path)
            except OSError as error:
                print(errno.errorcode[error.errno])
        try:
            os.mkdir('/tmp')
        except OSError as error:
            print(errno.errorcode[error.errno])
        open('inside.txt', 'w').write('scratch works')
        print(open('inside.txt').read())"""))
    lines = observation.output.splitlines()
    assert lines[0] == "ENOENT" and set(lines[1:len(targets) + 1]) <= {"EROFS", "EACCES"}, lines
    assert lines[len(targets) + 1:] == ["scratch works"]
    assert not any(Path(target).exists() for target in [f"/tmp/{name}", f"/{name}", f"/usr/lib/{name}"])
    observation, _ = run(session, "import os\nprint(sorted(os.listdir('.')))")  # a new call: a new, empty scratch
    assert observation.output == "['main.py']\n"


def test_no_network_not_even_the_servers_own_port(session, env_server):
    observation, _ = run(session, dedent(f"""
        import errno, socket
        for address in [('127.0.0.1', {env_server.port}), ('8.8.8.8', 53)]:
            try:
                socket.create_connection(address, timeout=2)
                print('CONNECTED', address)
            except OSError as error:
                print(errno.errorcode.get(error.errno, error))"""))
    assert observation.output == "ENETUNREACH\nENETUNREACH\n"


def test_an_endless_loop_is_killed_at_its_cpu_limit(session):
    observation, seconds = run(session, "while True:\n    pass")
    assert observation.exit_code in (-signal.SIGXCPU, -signal.SIGKILL) and not observation.timed_out
    assert observation.output == f"[killed: used more than the CPU time limit of {CPU_S} s]"
    assert CPU_S * 0.9 <= observation.cpu_s < CPU_S + 1.5 and seconds < WALL_S + 1


def test_a_sleeping_snippet_and_its_detached_child_die_at_the_wall_limit(session):
    observation, seconds = run(session, dedent(f"""
        import os, time
        if os.fork() == 0:
            os.setsid()
            time.sleep({WALL_S + 1})
            print('child survived', flush=True)
        else:
            print('parent started', flush=True)
            time.sleep(60)"""))
    assert observation.timed_out and observation.exit_code == -signal.SIGKILL
    assert observation.output == f"parent started\n[killed: ran past the time limit of {WALL_S} s]"
    assert WALL_S <= seconds < WALL_S + 1  # returned before the child would have printed
    assert sandbox_processes() == []


def test_a_forked_child_does_not_outlive_its_snippet(session):
    # the child lets go of the output pipes, so only the process table can tell whether it still runs
    observation, seconds = run(session, dedent("""
        import os, time
        if os.fork() == 0:
            os.setsid()
            os.close(1)
            os.close(2)
            time.sleep(30)
        else:
            time.sleep(0.2)
            print('parent done')"""))
    assert (observation.output, observation.exit_code, observation.timed_out) == ("parent done\n", 0, False)
    assert seconds < WALL_S and sandbox_processes() == []


def test_a_fork_bomb_stops_at_the_process_limit(session):
    from trl_opd.envs.code_env.sandbox import PROCESSES

    observation, seconds = run(session, dedent("""
        import os, time
        children = 0
        try:
            for _ in range(1000):
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                children += 1
        except BlockingIOError:
            print('fork refused after', children, 'children')"""))
    assert observation.output == f"fork refused after {PROCESSES - 1} children\n"  # the snippet is the 16th
    assert seconds < WALL_S and sandbox_processes() == []


def test_memory_over_the_limit_fails(session):
    observation, _ = run(session, dedent(f"""
        x = bytearray(64 << 20)
        print(len(x))
        del x
        try:
            y = bytearray({2 * MEMORY_MB} << 20)
            print('ALLOCATED')
        except MemoryError:
            print('MemoryError')"""))
    assert observation.output == f"{64 << 20}\nMemoryError\n"


def test_a_file_over_the_size_limit_fails(session):
    observation, _ = run(session, dedent(f"""
        import errno
        try:
            open('big', 'wb').write(b'x' * ({2 * FILE_MB} << 20))
            print('WROTE')
        except OSError as error:
            print(errno.errorcode[error.errno])"""))
    assert observation.output == "EFBIG\n"


# ------------------------------------------------------------------------------------------- episodes and protocol


def test_an_unknown_tool_or_bad_arguments_are_refused_naming_what_is_accepted(session):
    session.reset()
    observation = call(session, tool="shell", cmd="ls")
    assert observation.error == "Unknown tool 'shell'. Known tools: run_python."
    assert observation.output == "Error: " + observation.error and observation.exit_code is None
    observation = call(session, source="print(1)")
    assert observation.error == "run_python takes one argument, `code` (Python source, a string); got ['source']."


def test_the_turn_limit_ends_the_episode(session):
    session.reset()
    observations = [call(session, code=f"print({turn})") for turn in range(MAX_TURNS)]
    assert [o.output for o in observations] == [f"{turn}\n" for turn in range(MAX_TURNS)]
    assert [o.done for o in observations] == [False] * (MAX_TURNS - 1) + [True]
    assert [o.turn for o in observations] == list(range(1, MAX_TURNS + 1))
    over = call(session, code="print('ran anyway')")
    assert over.done and over.exit_code is None
    assert over.error == f"The episode is over: it allows {MAX_TURNS} tool calls, and all were made."
    assert session.state().step_count == MAX_TURNS
    session.reset()  # a new episode on the same session
    assert call(session, code="print('again')").output == "again\n"


def test_malformed_actions_are_answered_with_a_clear_error(env_server):
    import requests
    from websockets.sync.client import connect

    garbage = requests.post(env_server.url + "/step", data="garbage", headers={"content-type": "application/json"})
    assert garbage.status_code == 422 and garbage.json()["detail"][0]["type"] == "json_invalid"
    wrong = requests.post(env_server.url + "/step", json={"action": {"tol": "run_python"}})
    assert wrong.status_code == 422
    assert {(e["type"], tuple(e["loc"])) for e in wrong.json()["detail"]} == {("missing", ("tool",)),
                                                                              ("extra_forbidden", ("tol",))}
    # plain HTTP steps are stateless in openenv-core 0.3.0 (a fresh environment each): nothing runs there
    stateless = requests.post(env_server.url + "/step", json={"action": {"tool": "run_python",
                                                                         "arguments": {"code": "print(1)"}}})
    assert stateless.json()["observation"]["error"].startswith("No episode")
    with connect(env_server.url.replace("http://", "ws://") + "/ws") as websocket:
        websocket.send("garbage")
        assert json.loads(websocket.recv())["data"]["code"] == "INVALID_JSON"
        websocket.send(json.dumps({"type": "step", "data": {"tool": 5}}))
        answer = json.loads(websocket.recv())
        assert (answer["type"], answer["data"]["code"]) == ("error", "VALIDATION_ERROR")
        assert [(e["type"], e["loc"]) for e in answer["data"]["errors"]] == [("string_type", ["tool"])]


def test_the_server_refuses_to_start_without_a_sandbox(monkeypatch):
    from trl_opd.envs.code_env.sandbox import Sandbox, SandboxUnavailable

    command = [sys.executable, "-m", "trl_opd.envs.code_env.server", "--port", "1"]
    missing = subprocess.run([sys.executable, "-m", "trl_opd", "serve-env", "--unshare", "/nonexistent/unshare"],
                             capture_output=True, text=True, cwd=ROOT)  # as `trl-opd serve-env`
    assert missing.returncode == 2 and "refusing to start" in missing.stderr
    assert "`/nonexistent/unshare` was not found" in missing.stderr
    broken = subprocess.run([*command, "--unshare", "false"], capture_output=True, text=True, cwd=ROOT)
    assert broken.returncode == 2 and "could not be set up on this machine" in broken.stderr
    sandbox = Sandbox()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxUnavailable, match="needs root"):
        sandbox.check()
    sandbox.close()


# ------------------------------------------------------------------------------------------------- the GRPO client


def test_the_grpo_environment_offers_run_python_and_runs_a_rows_episode(env_server):
    import inspect

    from transformers.utils import get_json_schema

    from trl_opd.envs.code_env import CodeToolClient
    from trl_opd.envs.code_output import code_row

    # TRL offers every public method but reset (and get_reward) to the model as a tool
    public = {name for name, _ in inspect.getmembers(CodeToolClient, inspect.isfunction) if not name.startswith("_")}
    assert public == {"reset", "run_python"}
    environment = CodeToolClient(env_server.url)
    schema = get_json_schema(environment.run_python)["function"]
    assert schema["name"] == "run_python" and schema["parameters"]["required"] == ["code"]
    assert schema["parameters"]["properties"]["code"]["type"] == "string"
    row = code_row("print('rocket'.upper())")
    assert environment.reset(**row) is None
    assert environment._open[0].state().program == "print('rocket'.upper())"
    assert environment.run_python("print('rocket'.upper())") == "ROCKET\n" == row["solution"] + "\n"
    assert environment.calls == [("print('rocket'.upper())", "ROCKET\n")] and not environment.done
    environment.reset(**row)
    assert environment.calls == []


def test_concurrent_episodes_stay_apart(env_server):
    """Rollouts run their episodes at once: each keeps its own session and turn count, and snippets running at the
    same time run under different sandbox uids."""
    from concurrent.futures import ThreadPoolExecutor

    from trl_opd.envs.code_env import CodeToolClient

    def episode(index: int) -> list[str]:
        environment = CodeToolClient(env_server.url)
        environment.reset(prompt="")
        code = f"import os, time\ntime.sleep(0.3)\nprint({index}, os.getuid())"
        return [environment.run_python(code) for _ in range(2)] + [str(environment._open[0].state().step_count)]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(episode, range(4)))
    for index, (first, second, turns) in enumerate(results):
        assert first.split()[0] == second.split()[0] == str(index) and turns == "2"
    assert len({output.split()[1] for first, second, _ in results for output in (first, second)}) >= 2
    assert sandbox_processes() == []


def test_the_reference_as_teacher_check_through_the_server_shows_a_rollout_with_its_mask_and_kl_0(
        env_server, tiny_agent, tmp_path, capsys, monkeypatch):
    """The smoke test of the whole data flow (server -> rollout -> old log-probs -> reference-as-teacher log-probs),
    as the real-model recipe's header runs it: `trl-opd check` with the recipe pointed at the running server, tiny
    models in place of the Qwen pair."""
    from trl_opd import cli
    from trl_opd.envs.code_output import TOOL_INSTRUCTION, code_rows

    dataset = tmp_path / "train.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n"
                               for row in code_rows(4, seed=0, distinct=False, instruction=TOOL_INSTRUCTION)))
    monkeypatch.setenv("OPD_ENV_SERVER_URL", env_server.url)
    argv = ["check", "--config", "recipes/agent_code_env_cpu.yaml", "--model_name_or_path", str(tiny_agent / "student"),
            "--teacher_model_name_or_path", str(tiny_agent / "teacher"), "--dataset_name", str(dataset),
            "--output_dir", str(tmp_path / "unused")]
    with pytest.raises(SystemExit) as exit_code:
        cli.main(argv)
    out = capsys.readouterr().out
    assert exit_code.value.code == 0
    assert "reference as teacher: opd/reverse_kl = 0.000000 (OK, 0 as expected)" in out
    # a multi-turn rollout, its tool turn outside the mask (the tiny student calls its arithmetic tools, which GRPO's
    # tool loop answers with a not-found error, run_python being the environment's only tool; the server is reached by
    # every episode's reset; the real models' run_python turns are in docs/multi-turn.md)
    rollout = out.split("a sampled rollout; the student is trained on every completion token outside")[1]
    assert "<|im_end|>⟦\n<|im_start|>tool\n" in rollout


def test_a_client_without_a_server_url_says_how_to_give_one(monkeypatch):
    from trl_opd.envs.code_env.client import ENV_VAR, CodeToolClient

    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(ValueError, match=ENV_VAR):
        CodeToolClient()
    monkeypatch.setenv(ENV_VAR, "http://127.0.0.1:9/")
    assert CodeToolClient().base_url == "http://127.0.0.1:9"


def test_a_server_lost_mid_run_stops_training_and_the_last_checkpoint_resumes(tiny_agent, make_config, tmp_path):
    """Its own server, stopped once step 1's checkpoint is written: step 2 fails naming the server and trains on
    nothing; with the server back, training resumes from that checkpoint."""
    import functools

    from datasets import Dataset
    from transformers import TrainerCallback

    from trl_opd import OPDTrainer
    from trl_opd.envs.code_env import CodeToolClient, EnvServerError
    from trl_opd.envs.code_output import TOOL_INSTRUCTION, code_rows

    server = EnvServerProcess(tmp_path / "server.log")
    server.start()
    server.wait_ready()
    rows = Dataset.from_list(code_rows(8, seed=0, distinct=False, instruction=TOOL_INSTRUCTION))
    output_dir = tmp_path / "run"

    def build():
        return OPDTrainer(model=str(tiny_agent / "student"), teacher_model=str(tiny_agent / "teacher"),
                          train_dataset=rows, environment_factory=functools.partial(CodeToolClient, server.url,
                                                                                    backoff_s=0.05),
                          args=make_config(output_dir=str(output_dir), max_steps=2, save_strategy="steps",
                                           save_steps=1, max_completion_length=16))

    class LoseTheServerAfterSaving(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            server.stop()

    try:
        trainer = build()
        trainer.add_callback(LoseTheServerAfterSaving())
        with pytest.raises(EnvServerError, match=f"The environment server at {server.url} did not answer the reset"):
            trainer.train()
        assert sorted(path.name for path in output_dir.glob("checkpoint-*")) == ["checkpoint-1"]
        state = json.loads((output_dir / "checkpoint-1" / "trainer_state.json").read_text())
        assert state["global_step"] == 1
        server.start()
        server.wait_ready()
        resumed = build()
        resumed.train(resume_from_checkpoint=True)
        assert resumed.state.global_step == 2
        assert json.loads((output_dir / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2
    finally:
        server.stop()


class MalformingServer:
    """A fault injector on a loopback port: a WebSocket server that answers a reset as the code tool server does and
    every step with `answer` (a raw text frame)."""

    def __init__(self, answer: str):
        import threading

        from websockets.sync.server import serve

        def handle(connection):
            for message in connection:
                kind = json.loads(message)["type"]
                if kind == "close":
                    return
                connection.send(json.dumps({"type": "observation", "data": {"observation": {"output": ""}}})
                                if kind == "reset" else answer)

        self.server = serve(handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.socket.getsockname()[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.mark.parametrize("answer", [
    "not json",
    json.dumps({"type": "observation", "data": {"observation": {}}}),  # no output: never an empty observation
    json.dumps({"type": "observation", "data": {"observation": {"output": 7}}}),
    json.dumps({"type": "observation", "data": {"observation": {"output": "1", "turn": "first"}}}),
], ids=["not-json", "no-output", "output-not-a-string", "a-field-of-the-wrong-type"])
def test_a_malformed_observation_stops_the_batch_naming_the_server(answer):
    """The server's answer to a tool call is not a code tool result: the call raises naming the server and what was
    wrong, the client records the failure, and the trainer's check stops before that batch is scored."""
    from accelerate import Accelerator

    from trl_opd.envs.code_env import CodeToolClient, EnvServerError
    from trl_opd.multiturn import check_environments

    server = MalformingServer(answer)
    try:
        environment = CodeToolClient(server.url)
        environment.reset(prompt="")
        with pytest.raises(EnvServerError) as malformed:
            environment.run_python("print(1)")
        message = str(malformed.value)
        assert message.startswith(f"The environment server at {server.url} sent a malformed answer to the run_python")
        assert environment.failure == message and environment.calls == []
        with pytest.raises(RuntimeError, match="lost their environment: The environment server at .* malformed"):
            check_environments([environment], Accelerator(cpu=True))
    finally:
        server.server.shutdown()


def test_a_killed_server_raises_an_error_naming_its_url(env_server):
    """Last in the file: it kills the session's server."""
    from trl_opd.envs.code_env import CodeToolClient, EnvServerError

    environment = CodeToolClient(env_server.url, backoff_s=0.05)
    environment.reset(prompt="")
    assert environment.run_python("print(1)") == "1\n"
    env_server.stop()
    with pytest.raises(EnvServerError) as lost:
        environment.run_python("print(2)")
    assert str(lost.value).startswith(f"The environment server at {env_server.url} did not answer the run_python call")
    assert "the episode in that session is lost" in str(lost.value)
    # GRPO shows the model that error and goes on; the trainer stops before the batch is scored or trained on
    assert environment.failure == str(lost.value)
    from accelerate import Accelerator

    from trl_opd.multiturn import check_environments

    accelerator, healthy = Accelerator(cpu=True), CodeToolClient(env_server.url)
    check_environments([healthy], accelerator)  # nothing lost: no error
    with pytest.raises(RuntimeError, match=f"lost their environment: The environment server at {env_server.url}"):
        check_environments([healthy, environment], accelerator)
    start = time.monotonic()
    with pytest.raises(EnvServerError) as unreachable:
        environment.reset(prompt="")
    message = str(unreachable.value)
    assert message.startswith(f"The environment server at {env_server.url} did not answer the reset (4 attempts)")
    assert f"{errno.ECONNREFUSED}" in message and time.monotonic() - start >= 0.05 + 0.1 + 0.2
