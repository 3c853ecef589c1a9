"""The code tool environment server (trl_opd/envs/code_env): its sandbox, tried and broken into, its episodes, its
wire protocol, and the GRPO client, against real server processes started for the session.

The sandbox's tests run against two servers: one as root, one as an unprivileged user (nobody) through user
namespaces; a developer who is not root runs the second only, as themself. The servers run with small limits so that
the limit tests are quick: 2 s wall, 1 s CPU, 256 MiB, 1 MiB files, 4 turns, 2 snippets at once.
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
WALL_S, CPU_S, MEMORY_MB, FILE_MB, MAX_TURNS, MAX_OUTPUT, MAX_PARALLEL = 2, 1, 256, 1, 4, 1024, 2
NOBODY = 65534
# As root, the unprivileged server runs as nobody in a mount namespace of its own where /root is traversable (0711,
# its entries bound back as they are): this machine's interpreter lives under /root, which is 0700, and a real user's
# interpreter is one they can read
AS_NOBODY = f"""
mkdir -p /run/opd-test-root && mount --bind /root /run/opd-test-root && mount -t tmpfs -o mode=0711 tmpfs /root &&
for entry in /run/opd-test-root/* /run/opd-test-root/.[!.]*; do
  [ -e "$entry" ] || continue; name=${{entry##*/}}
  if [ -d "$entry" ]; then mkdir "/root/$name"; else touch "/root/$name"; fi; mount --rbind "$entry" "/root/$name"
done && exec setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups -- "$@"
"""
PRIVILEGES = ["root", "user"] if os.geteuid() == 0 else ["user"]


class EnvServerProcess:
    """`python -m trl_opd.envs.code_env.server` on a free loopback port, as root or not: start, wait for /health,
    stop its group. `wrapper` goes before the command (a fault injector)."""

    def __init__(self, log: Path, privileges: str = PRIVILEGES[0], wrapper: tuple[str, ...] = (), env=None):
        from trl_opd.tools.testing import free_port

        self.log, self.port, self.privileges, self.wrapper, self.env = log, free_port(), privileges, wrapper, env
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = None

    def command(self, *arguments: str) -> list[str]:
        command = [*self.wrapper, sys.executable, "-m", "trl_opd.envs.code_env.server", "--host", "127.0.0.1",
                   "--port", str(self.port), "--wall-time", str(WALL_S), "--cpu-time", str(CPU_S), "--memory-mb",
                   str(MEMORY_MB), "--file-mb", str(FILE_MB), "--max-turns", str(MAX_TURNS), "--max-output",
                   str(MAX_OUTPUT), "--max-parallel", str(MAX_PARALLEL), *arguments]
        if self.privileges == "user" and os.geteuid() == 0:
            command = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", AS_NOBODY, "sh",
                       *command]
        return command

    def start(self, *arguments: str) -> None:
        with open(self.log, "a") as out:
            self.process = subprocess.Popen(self.command(*arguments), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                            start_new_session=True, env=self.env)

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

    def metadata(self) -> dict:
        import requests

        return requests.get(self.url + "/metadata", timeout=5).json()

    def stop(self) -> None:
        """Stop the server's whole process group and wait until it is gone."""
        from trl_opd.tools.testing import stop_process_group

        stop_process_group(self.process, timeout=15)

    def sandbox_processes(self) -> list[str]:
        """The server's descendant processes (a snippet's init, its PID 1, the snippet and its children), as
        "pid name"; the server itself and its wrapper are not among them."""
        children: dict[int, list[int]] = {}
        names = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                text = stat.read_text()
            except OSError:  # the process ended while being read
                continue
            pid, rest = int(text.split(" ", 1)[0]), text.rsplit(")", 1)
            names[pid] = text[text.index("(") + 1:text.rindex(")")]
            children.setdefault(int(rest[1].split()[1]), []).append(pid)
        # the server is the process started (unshare, sh and setpriv each exec the next)
        found, stack = [], list(children.get(self.process.pid, []))
        while stack:
            pid = stack.pop()
            found.append(f"{pid} {names[pid]}")
            stack.extend(children.get(pid, []))
        return found


@pytest.fixture(scope="session", params=PRIVILEGES)
def env_server(request, tmp_path_factory):
    server = EnvServerProcess(tmp_path_factory.mktemp("env_server") / "server.log", request.param)
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


def connect(server):
    from websockets.sync.client import connect

    return connect(server.url.replace("http://", "ws://") + "/ws")


def test_the_servers_run_as_the_privileges_they_are_tested_for(env_server):
    sandbox = env_server.metadata()["sandbox"]
    status = Path(f"/proc/{env_server.process.pid}/status").read_text()
    uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
    if env_server.privileges == "root":
        assert uid == 0 and sandbox["privileges"] == "root, a uid per slot" and sandbox["budget"].startswith("cgroup")
    else:
        assert uid == (NOBODY if os.geteuid() == 0 else os.geteuid()) and sandbox["privileges"] == "user namespace"


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
            "try:\n    os.setuid(0)\nexcept OSError:\n    print('setuid refused')")  # EINVAL in a user namespace
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


def test_a_sleeping_snippet_and_its_detached_child_die_at_the_wall_limit(session, env_server):
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
    assert env_server.sandbox_processes() == []


def test_a_forked_child_does_not_outlive_its_snippet(session, env_server):
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
    assert seconds < WALL_S and env_server.sandbox_processes() == []


def test_a_fork_bomb_stops_at_the_process_limit(session, env_server):
    processes = env_server.metadata()["sandbox"]["processes"]
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
    assert observation.output == f"fork refused after {processes - 1} children\n"  # the snippet is the last
    assert seconds < WALL_S and env_server.sandbox_processes() == []


def test_memory_over_the_limit_fails(session):
    observation, _ = run(session, dedent(f"""
        x = bytearray(16 << 20)
        print(len(x))
        del x
        try:
            y = bytearray({2 * MEMORY_MB} << 20)
            print('ALLOCATED')
        except MemoryError:
            print('MemoryError')"""))
    assert observation.output == f"{16 << 20}\nMemoryError\n"


def test_a_file_over_the_size_limit_fails(session):
    observation, _ = run(session, dedent(f"""
        import errno
        try:
            open('big', 'wb').write(b'x' * ({2 * FILE_MB} << 20))
            print('WROTE')
        except OSError as error:
            print(errno.errorcode[error.errno])"""))
    assert observation.output == "EFBIG\n"


def test_the_memory_budget_holds_for_all_of_a_snippets_processes_together(session, env_server):
    """Children that each allocate and hold a share of memory at the same time: together they never hold more than
    the snippet's budget (a cgroup's OOM killer, or each process's share of the budget), though one alone may."""
    sandbox = env_server.metadata()["sandbox"]
    share_mb = 100 if sandbox["budget"].startswith("cgroup") else MEMORY_MB // sandbox["processes"] - 32
    observation, _ = run(session, dedent(f"""
        import os, time
        children = []
        for _ in range(4):
            try:
                pid = os.fork()
            except BlockingIOError:
                break
            if pid == 0:
                try:
                    held = bytearray({share_mb} << 20)
                    held[::4096] = b'x' * len(held[::4096])  # every page written, so resident
                except MemoryError:
                    os._exit(3)
                time.sleep(1)  # every child holds its share at once
                os._exit(0)
            children.append(pid)
        print(sorted(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children))"""))
    statuses = ast.literal_eval(observation.output.splitlines()[0])
    assert 1 <= statuses.count(0) and statuses.count(0) * share_mb <= MEMORY_MB, (sandbox, statuses)


def test_the_cpu_budget_holds_for_all_of_a_snippets_processes_together(session):
    """Four processes spinning at once are killed when together they have used the CPU limit, not each of them."""
    observation, seconds = run(session, dedent("""
        import os
        for _ in range(3):
            if os.fork() == 0:
                break
        while True:
            pass"""))
    assert observation.output == f"[killed: used more than the CPU time limit of {CPU_S} s]"
    assert not observation.timed_out and CPU_S <= observation.cpu_s < CPU_S * 1.5 and seconds < WALL_S


def test_nothing_persists_between_snippets_through_keyrings(session):
    """A key added to the uid's keyring would outlive the snippet and reach the next one of that uid."""
    keyrings = dedent("""
        import ctypes, errno
        libc = ctypes.CDLL(None, use_errno=True)
        def result(value):
            return errno.errorcode[ctypes.get_errno()] if value == -1 else 'returned ' + str(value)
        print(result(libc.syscall({add_key}, b'user', b'opd-probe', b'secret', 6, -4)))  # to the user keyring
        print(result(libc.syscall({request_key}, b'user', b'opd-probe', None, 0)))
        print(result(libc.syscall({keyctl}, 0, -4, 0)))  # KEYCTL_GET_KEYRING_ID of the user keyring""")
    numbers = {"x86_64": {"add_key": 248, "request_key": 249, "keyctl": 250},
               "aarch64": {"add_key": 217, "request_key": 218, "keyctl": 219}}
    code = keyrings.format(**numbers[os.uname().machine])
    first, _ = run(session, code)
    second, _ = run(session, code)
    assert first.output == second.output == "EPERM\nEPERM\nEPERM\n"


def test_no_new_namespace_capability_or_kernel_interface_is_reachable(session):
    """The steps of the nf_tables escalations and their kin: a user namespace of its own (then capabilities in it),
    joining a namespace, mounting, io_uring, bpf, perf_event_open, userfaultfd, ptrace."""
    observation, _ = run(session, dedent("""
        import ctypes, errno, os
        libc = ctypes.CDLL(None, use_errno=True)
        calls = {"x86_64": {"setns": 308, "io_uring_setup": 425, "bpf": 321, "perf_event_open": 298,
                            "userfaultfd": 323, "ptrace": 101},
                 "aarch64": {"setns": 268, "io_uring_setup": 425, "bpf": 280, "perf_event_open": 241,
                             "userfaultfd": 282, "ptrace": 117}}[os.uname().machine]
        def result(value):
            return errno.errorcode[ctypes.get_errno()] if value == -1 else 'returned ' + str(value)
        for flag in (0x10000000, 0x20000, 0x40000000, 0x20000000):  # NEWUSER, NEWNS, NEWNET, NEWPID
            print('unshare', result(libc.unshare(flag)))
        print('clone', result(libc.syscall(56 if os.uname().machine == 'x86_64' else 220, 0x10000000 | 17, 0, 0, 0, 0)))
        print('setns', result(libc.syscall(calls['setns'], 0, 0)))
        print('mount', result(libc.mount(b'tmpfs', b'/scratch', b'tmpfs', 0, None)))
        print('io_uring_setup', result(libc.syscall(calls['io_uring_setup'], 1, ctypes.create_string_buffer(120))))
        print('bpf', result(libc.syscall(calls['bpf'], 0, None, 0)))
        print('perf_event_open', result(libc.syscall(calls['perf_event_open'], ctypes.create_string_buffer(128),
                                                     0, -1, -1, 0)))
        print('userfaultfd', result(libc.syscall(calls['userfaultfd'], 0)))
        print('ptrace', result(libc.syscall(calls['ptrace'], 16, 1, 0, 0)))  # PTRACE_ATTACH to PID 1, the init
        print('fork', 'works' if os.waitpid(os.fork() or os._exit(0), 0) else '')  # clone without namespaces"""))
    lines = observation.output.splitlines()
    assert lines[:4] == ["unshare EPERM"] * 4 and lines[-1] == "fork works", lines
    assert lines[4:-1] == [f"{name} EPERM" for name in ("clone", "setns", "mount", "io_uring_setup", "bpf",
                                                         "perf_event_open", "userfaultfd", "ptrace")], lines


def test_snippets_cannot_signal_each_other_through_locks_or_file_watches(session):
    """Snippets running at once read the same interpreter files: a lock or a watch on one would be a channel."""
    observation, _ = run(session, dedent("""
        import ctypes, errno, fcntl, os, sys
        libc = ctypes.CDLL(None, use_errno=True)
        shared = open(sys.executable, 'rb')
        for name, lock in [('flock', lambda: fcntl.flock(shared, fcntl.LOCK_EX)),
                           ('lockf', lambda: fcntl.lockf(shared, fcntl.LOCK_SH)),
                           ('F_GETLK', lambda: fcntl.fcntl(shared, fcntl.F_GETLK, bytes(32)))]:
            try:
                lock()
                print(name, 'allowed')
            except OSError as error:
                print(name, errno.errorcode[error.errno])
        print('inotify', errno.errorcode[ctypes.get_errno()] if libc.inotify_init1(0) == -1 else 'allowed')"""))
    assert observation.output == "flock ENOLCK\nlockf ENOLCK\nF_GETLK ENOLCK\ninotify EPERM\n"


def test_the_snippet_gets_the_standard_library_only(session):
    observation, _ = run(session, dedent("""
        import os, sys
        print(sys.flags.no_site, [path for path in sys.path if 'site-packages' in path])
        site_packages = os.path.join(sys.prefix, 'lib', f'python{sys.version_info[0]}.{sys.version_info[1]}',
                                     'site-packages')
        print(os.listdir(site_packages))
        import json, sqlite3
        print('stdlib imports')"""))
    assert observation.output == "1 []\n[]\nstdlib imports\n"


def test_the_sandbox_init_gets_an_empty_environment(env_server, session):
    """The server's environment (where a trainer's secrets may live) never reaches the sandbox: its init and PID 1
    run with none, the snippet with the four variables it is given."""
    import threading

    def processes() -> dict[int, tuple[bytes, bytes]]:
        found = {}
        for entry in env_server.sandbox_processes():
            pid = int(entry.split()[0])
            try:
                found[pid] = (Path(f"/proc/{pid}/cmdline").read_bytes(), Path(f"/proc/{pid}/environ").read_bytes())
            except OSError:  # it ended meanwhile
                pass
        return found

    thread = threading.Thread(target=run, args=(session, "import time\ntime.sleep(1)"))
    thread.start()
    deadline, seen = time.monotonic() + 5, {}
    while time.monotonic() < deadline and not any(b"main.py" in cmdline for cmdline, _ in seen.values()):
        seen.update(processes())
        time.sleep(0.05)
    thread.join()
    inits = [environ for cmdline, environ in seen.values() if b"sandbox_init.py" in cmdline]
    snippets = [environ for cmdline, environ in seen.values() if b"main.py" in cmdline]
    # PID 1 is not dumpable, so only root reads its environment (a user who is not root sees the init's)
    assert inits == [b""] * (2 if os.geteuid() == 0 else 1), seen
    assert [sorted(v.split(b"=")[0] for v in environ.split(b"\0") if v) for environ in snippets] == [
        [b"HOME", b"LANG", b"PATH", b"TMPDIR"]], seen


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


def test_malformed_frames_are_answered_with_an_error_and_the_session_goes_on(env_server):
    """Whatever a client sends (binary, not JSON, not an object, an unknown type, a bad action), it is told what was
    wrong, and its episode is still there: the next tool call is its second turn."""
    step = {"type": "step", "data": {"tool": "run_python", "arguments": {"code": "print(7)"}}}
    with connect(env_server) as websocket:
        websocket.send(json.dumps({"type": "reset", "data": {}}))
        assert json.loads(websocket.recv())["type"] == "observation"
        websocket.send(json.dumps(step))
        assert json.loads(websocket.recv())["data"]["observation"]["turn"] == 1
        for frame, code in [(b"\x00binary", "INVALID_JSON"), ("garbage", "INVALID_JSON"),
                            ("[1, 2]", "VALIDATION_ERROR"), ('"step"', "VALIDATION_ERROR"),
                            ('{"type": "nope"}', "UNKNOWN_TYPE"),
                            ('{"type": "step", "data": [1]}', "VALIDATION_ERROR")]:
            websocket.send(frame)
            answer = json.loads(websocket.recv())
            assert (answer["type"], answer["data"]["code"]) == ("error", code), (frame, answer)
        websocket.send(json.dumps({"type": "step", "data": {"tool": 5}}))
        answer = json.loads(websocket.recv())
        assert (answer["type"], answer["data"]["code"]) == ("error", "VALIDATION_ERROR")
        assert [(e["type"], e["loc"]) for e in answer["data"]["errors"]] == [("string_type", ["tool"])]
        websocket.send(json.dumps(step))
        observation = json.loads(websocket.recv())["data"]["observation"]
        assert (observation["output"], observation["turn"]) == ("7\n", 2)


def test_only_the_environments_routes_are_served(env_server):
    """No OpenEnv route this environment does not use: in particular no HTTP /mcp, whose session/create made
    sessions that no connection held, until none was left for training clients."""
    import requests

    assert requests.get(env_server.url + "/health").json() == {"status": "healthy"}
    metadata = env_server.metadata()
    assert metadata["name"] == "code_tool" and metadata["max_turns"] == MAX_TURNS
    assert metadata["sandbox"]["memory_mb"] == MEMORY_MB and metadata["sandbox"]["max_parallel"] == MAX_PARALLEL
    assert requests.get(env_server.url + "/schema").json()["action"]["title"] == "ToolCall"
    create = {"jsonrpc": "2.0", "id": 1, "method": "openenv/session/create", "params": {}}
    for method, path, body in [("post", "/mcp", create), ("post", "/reset", {}), ("post", "/step", {}),
                               ("get", "/state", None), ("get", "/docs", None), ("get", "/openapi.json", None)]:
        answer = getattr(requests, method)(env_server.url + path, json=body)
        assert answer.status_code == 404, (path, answer.status_code, answer.text[:200])


def test_sessions_are_connections_and_capacity_frees_when_one_ends(tmp_path):
    """A server of one session: a second connection is refused while the first lives, HTTP calls take none, and the
    next connection gets the session once the first has gone."""
    import requests

    server = EnvServerProcess(tmp_path / "server.log")
    server.start("--max-sessions", "1")
    try:
        server.wait_ready()
        for _ in range(5):
            requests.post(server.url + "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "openenv/session/create"})
        with connect(server) as first:
            with connect(server) as second:
                refused = json.loads(second.recv())
            assert refused["data"]["code"] == "CAPACITY_REACHED" and refused["data"]["max_sessions"] == 1
            first.send(json.dumps({"type": "reset", "data": {}}))
            assert json.loads(first.recv())["type"] == "observation"
        deadline = time.monotonic() + 5
        while True:
            with connect(server) as third:
                third.send(json.dumps({"type": "reset", "data": {}}))
                answer = json.loads(third.recv())
            if answer["type"] == "observation" or time.monotonic() > deadline:
                break
            time.sleep(0.1)  # the server has not yet seen the first connection close
        assert answer["type"] == "observation", answer
    finally:
        server.stop()


def test_a_client_that_goes_away_has_its_snippet_killed(env_server, session):
    """Two clients start snippets that would hold both slots for most of the wall limit, then disconnect: their
    snippets are killed at once, so the next call runs without waiting for a slot and nothing is left running."""
    step = {"type": "step", "data": {"tool": "run_python",
                                     "arguments": {"code": f"import time\ntime.sleep({WALL_S * 0.9})"}}}
    for _ in range(MAX_PARALLEL):
        with connect(env_server) as websocket:
            websocket.send(json.dumps({"type": "reset", "data": {}}))
            websocket.recv()
            websocket.send(json.dumps(step))
            time.sleep(0.3)  # the snippet has started
    observation, seconds = run(session, "print('ran at once')")
    assert observation.output == "ran at once\n" and seconds < WALL_S * 0.5
    deadline = time.monotonic() + 2
    while env_server.sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert env_server.sandbox_processes() == []


# installs a filter that refuses unshare(2), then runs the command it is given: a machine without namespaces
NO_NAMESPACES = """
import ctypes, os, sys
from trl_opd.envs.code_env.sandbox_init import PR_SET_NO_NEW_PRIVS, install_filter
from trl_opd.envs.code_env.seccomp import compile_filter
ctypes.CDLL(None).prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
install_filter(compile_filter(("unshare",), whole=False))
os.execv(sys.argv[1], sys.argv[1:])
"""


def test_the_server_refuses_to_start_without_a_sandbox(monkeypatch, tmp_path):
    from trl_opd.envs.code_env import sandbox as sandbox_module

    refused = subprocess.run([sys.executable, "-c", NO_NAMESPACES, sys.executable, "-m", "trl_opd", "serve-env",
                              "--port", "1"], capture_output=True, text=True, cwd=ROOT)  # as `trl-opd serve-env`
    assert refused.returncode == 2 and "refusing to start" in refused.stderr
    assert "could not be set up on this machine" in refused.stderr
    assert "unshare: Operation not permitted" in refused.stderr
    # not root, and user namespaces switched off: the reason and the ways out are named
    setting = tmp_path / "max_user_namespaces"
    setting.write_text("0\n")
    monkeypatch.setattr(sandbox_module, "USERNS_SETTINGS", {str(setting): ("0", "user.max_user_namespaces is 0")})
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    sandbox = sandbox_module.Sandbox()
    try:
        with pytest.raises(sandbox_module.SandboxUnavailable) as unavailable:
            sandbox.check()
    finally:
        sandbox.close()
    assert str(unavailable.value).startswith("The sandbox needs root or unprivileged user namespaces, and "
                                             "user.max_user_namespaces is 0: run the server as root")
    monkeypatch.undo()
    # no cgroup, and more processes than the memory can be split between
    monkeypatch.setattr(sandbox_module.SnippetCgroups, "create", classmethod(lambda *a: (None, "none here")))
    sandbox = sandbox_module.Sandbox(memory_mb=256, processes=16)
    try:
        with pytest.raises(sandbox_module.SandboxUnavailable, match="each of a snippet's 16 processes gets 16 MiB of "
                                                                    "its 256 MiB.*lower --processes \\(to 4, say\\)"):
            sandbox.check()
    finally:
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
    assert env_server.sandbox_processes() == []


@pytest.mark.parametrize("env_server", PRIVILEGES[:1], indirect=True)  # the data flow, once
def test_the_reference_as_teacher_check_through_the_server_shows_a_rollout_with_its_mask_and_kl_0(
        env_server, tiny_agent, tmp_path, capsys, monkeypatch):
    """The smoke test of the whole data flow (server -> rollout -> old log-probs -> reference-as-teacher log-probs),
    as the real-model recipe's header runs it: `trl-opd check` with the recipe pointed at the running server, tiny
    models in place of the Qwen pair."""
    from trl_opd.envs.code_output import TOOL_INSTRUCTION, code_rows
    from trl_opd.tools import cli

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
    from trl_opd.trainer.multiturn import check_environments

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


def test_a_killed_server_raises_an_error_naming_its_url(tmp_path, request):
    """Its own server, killed mid-episode."""
    from trl_opd.envs.code_env import CodeToolClient, EnvServerError

    env_server = EnvServerProcess(tmp_path / "server.log")
    env_server.start()
    request.addfinalizer(env_server.stop)
    env_server.wait_ready()
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

    from trl_opd.trainer.multiturn import check_environments

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
