"""Run untrusted Python snippets, one fresh confined process each (Linux namespaces, a private root, resource limits).

Each snippet runs as `python -I -X utf8 -B main.py` (the server's base interpreter, standard library only) under
`unshare --mount --net --pid --ipc --uts --cgroup --fork --kill-child`, with `sandbox_init.py` as PID 1 of those
namespaces, which sets up:

- **files**: the root is an empty read-only tmpfs holding read-only bind mounts of the interpreter's prefix and the
  system libraries it links (`/usr/lib`, `/usr/lib64`, or `/lib*` where those are directories), `/dev/null`,
  `/dev/zero`, `/dev/random`, `/dev/urandom`, and `/scratch`, the working directory: a tmpfs of its own, empty when the
  snippet starts and gone when it ends (nothing persists between calls, as the interpreter's variables do not). Nothing
  else of the host exists there: no `/etc`, `/tmp`, `/proc`, `/home`, no repository.
- **network**: a network namespace whose only interface (loopback) is down: no connection anywhere, loopback included.
- **privileges**: a uid of its own (`uid_base + slot`, a different one for each snippet running at the same time), no
  capabilities, `no_new_privs`.
- **limits**, per process: address space `memory_mb` (RLIMIT_AS), CPU time `cpu_s` (SIGXCPU, then SIGKILL a second
  later), file size `file_mb`, 64 open files, 16 processes of its uid; `/scratch` holds at most `scratch_mb`.
- **time**: after `wall_s` the init kills every process of the namespace. A PID namespace dies with its PID 1, so when
  the snippet ends (or the server kills the run) nothing it started survives, not even a child that called setsid().

Needs Linux >= 5.3 (x86_64 or aarch64), root, and util-linux's `unshare`. `Sandbox.check()` proves the confinement on
this machine with a probe snippet; the server refuses to start when it fails.
"""

from __future__ import annotations

import json
import os
import platform
import queue
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .sandbox_init import SYS_PIVOT_ROOT

UID_BASE = 200000  # sandbox uids: UID_BASE .. UID_BASE + max_parallel - 1, owned by nothing on the host
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
LIBRARY_DIRS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32")
MAX_CODE_BYTES = 64 * 1024
OPEN_FILES, PROCESSES = 64, 16  # per snippet process; processes are counted per uid, so per snippet
GRACE_S = 5.0  # beyond wall_s, how long the server waits for the init before killing the run itself
INIT = Path(__file__).with_name("sandbox_init.py")

PROBE = """
import errno, json, os, socket
try:
    socket.create_connection(("127.0.0.1", 9), timeout=2).close()
    network = "connected"
except OSError as error:
    network = errno.errorcode.get(error.errno, str(error))
print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "cwd": os.getcwd(), "root": sorted(os.listdir("/")),
                  "network": network}))
"""


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot confine snippets on this machine; the message says what is missing."""


class SandboxError(RuntimeError):
    """A run failed on the sandbox's side (its setup), not the snippet's."""


@dataclass
class RunResult:
    """What one snippet did. `stdout`/`stderr` hold at most `keep_bytes` of each (`clipped` when either was longer;
    the `*_bytes` counts are whole); `exit_code` is negative for a signal (-24, SIGXCPU: over its CPU time);
    `timed_out`: killed at the wall-clock limit."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    cpu_s: float | None
    stdout_bytes: int
    stderr_bytes: int
    clipped: bool
    wall_s: float


class Sandbox:
    """Runs snippets confined as the module docstring says; at most `max_parallel` at a time (others wait)."""

    def __init__(self, *, wall_s: float = 10.0, cpu_s: int = 5, memory_mb: int = 512, file_mb: int = 8,
                 scratch_mb: int = 16, max_parallel: int | None = None, keep_bytes: int = 64 * 1024,
                 uid_base: int = UID_BASE, unshare: str = "unshare"):
        self.wall_s, self.cpu_s, self.memory_mb, self.file_mb = float(wall_s), int(cpu_s), memory_mb, file_mb
        self.scratch_mb, self.keep_bytes, self.uid_base, self.unshare = scratch_mb, keep_bytes, uid_base, unshare
        self.max_parallel = max_parallel or max(2, os.cpu_count() or 1)
        self._slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(self.max_parallel):
            self._slots.put(slot)
        self.python = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
        self.read_only, self.symlinks = _read_only_paths(self.python)
        self._dir = tempfile.mkdtemp(prefix="opd-sandbox-")  # the root's mount point and the snippets' sources
        os.mkdir(os.path.join(self._dir, "root"))

    def uids(self) -> range:
        return range(self.uid_base, self.uid_base + self.max_parallel)

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    def check(self) -> None:
        """Raise SandboxUnavailable, saying what is missing, unless a probe snippet runs confined here: its own uid,
        /scratch as working directory, nothing of the host's tree in its root, and no network."""
        if not sys.platform.startswith("linux") or platform.machine() not in SYS_PIVOT_ROOT:
            raise SandboxUnavailable(f"The sandbox needs Linux on x86_64 or aarch64, not {sys.platform} "
                                     f"{platform.machine()}.")
        if os.geteuid() != 0:
            raise SandboxUnavailable("The sandbox needs root: it mounts a private root for each snippet and drops "
                                     "the snippet to a uid of its own. Run the environment server as root (e.g. in "
                                     "its own container).")
        if shutil.which(self.unshare) is None:
            raise SandboxUnavailable(f"`{self.unshare}` was not found: the sandbox starts each snippet in new "
                                     "namespaces with util-linux's unshare (apt-get install util-linux).")
        try:
            result = self.run(PROBE)
            seen = json.loads(result.stdout)
        except (SandboxError, ValueError) as error:
            raise SandboxUnavailable(f"The sandbox could not be set up on this machine: {error}") from error
        expected_root = sorted({path.split("/")[1] for path in [*self.read_only, *self.symlinks, *DEVICES]}
                               | {"scratch"})
        problems = [f"{what}: {seen[key]!r}, expected {want!r}" for what, key, want, ok in (
            ("uid", "uid", f"one of {self.uid_base}..{self.uids()[-1]}", seen["uid"] in self.uids()),
            ("working directory", "cwd", "/scratch", seen["cwd"] == "/scratch"),
            ("root directory", "root", expected_root, seen["root"] == expected_root),
            ("connecting to loopback", "network", "ENETUNREACH", seen["network"] == "ENETUNREACH"),
        ) if not ok]
        if problems:
            raise SandboxUnavailable("The sandbox does not confine snippets on this machine: " + "; ".join(problems))

    def run(self, code: str) -> RunResult:
        """Run `code` (at most 64 KiB of UTF-8) in a fresh sandbox, waiting for a free slot first."""
        source = code.encode("utf-8", errors="replace")
        if len(source) > MAX_CODE_BYTES:
            raise ValueError(f"The snippet is {len(source)} bytes; at most {MAX_CODE_BYTES} are run.")
        slot = self._slots.get()
        try:
            return self._run(source, slot)
        finally:
            self._slots.put(slot)

    def _config(self, source_path: str, slot: int, status_fd: int) -> dict:
        mib = 2**20
        return {
            "root": os.path.join(self._dir, "root"), "read_only": self.read_only, "symlinks": self.symlinks,
            "devices": [device for device in DEVICES if os.path.exists(device)], "source": source_path,
            "uid": self.uid_base + slot, "gid": self.uid_base + slot, "python": self.python, "wall_s": self.wall_s,
            "scratch_bytes": self.scratch_mb * mib, "status_fd": status_fd,
            "limits": {"address_space": self.memory_mb * mib, "cpu": [self.cpu_s, self.cpu_s + 1],
                       "file_size": self.file_mb * mib, "open_files": OPEN_FILES, "processes": PROCESSES, "core": 0},
        }

    def _command(self, config: dict) -> list[str]:
        return [self.unshare, "--mount", "--net", "--pid", "--ipc", "--uts", "--cgroup", "--fork", "--kill-child",
                "--propagation", "private", "--", self.python, "-I", "-S", str(INIT), json.dumps(config)]

    def _run(self, source: bytes, slot: int) -> RunResult:
        fd, source_path = tempfile.mkstemp(dir=self._dir, suffix=".py")
        with os.fdopen(fd, "wb") as file:
            file.write(source)
        status_read, status_write = os.pipe()
        start = time.monotonic()
        try:
            command = self._command(self._config(source_path, slot, status_write))
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, pass_fds=(status_write,), start_new_session=True)
            os.close(status_write)
            status_write = None
            streams = [process.stdout.fileno(), process.stderr.fileno(), status_read]
            finished = False
            try:
                kept, total, finished = _drain(streams, self.keep_bytes, start + self.wall_s + GRACE_S)
            finally:
                if not finished:  # the init did not end the run in time (or reading failed): end it from here
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                process.stdout.close()
                process.stderr.close()
        finally:
            os.unlink(source_path)
            os.close(status_read)
            if status_write is not None:
                os.close(status_write)
        stdout, stderr, status = (bytes(kept[fd]) for fd in streams)
        stderr_text = stderr.decode("utf-8", errors="replace")
        if finished and not status:
            raise SandboxError(f"the sandbox's init ended ({process.returncode}) without a status: {stderr_text}")
        status = json.loads(status) if status else {"exit_code": None, "timed_out": True, "cpu_s": None}
        if status.get("setup_error"):
            raise SandboxError(f"the snippet could not be started: {status['setup_error']}")
        return RunResult(stdout.decode("utf-8", errors="replace"), stderr_text, status["exit_code"],
                         status["timed_out"], status["cpu_s"], total[streams[0]], total[streams[1]],
                         max(total[streams[0]], total[streams[1]]) > self.keep_bytes, time.monotonic() - start)


def _read_only_paths(python: str) -> tuple[list[str], dict[str, str]]:
    """The directories the sandbox binds read-only (the interpreter's prefix, the system library directories, no
    one inside another) and the top-level symlinks it recreates (`/lib -> usr/lib` on a merged-/usr system)."""
    binds, symlinks = [os.path.realpath(sys.base_prefix)], {}
    for path in LIBRARY_DIRS:
        if os.path.islink(path) and path.count("/") == 1:
            symlinks[path] = os.readlink(path)
        elif os.path.isdir(path) and not os.path.islink(path):
            binds.append(path)
    if not any(python.startswith(path + "/") for path in binds):
        binds.append(python)
    return sorted(p for p in binds if not any(p.startswith(other + "/") for other in binds)), symlinks


def _drain(fds: list[int], keep: int, deadline: float) -> tuple[dict[int, bytearray], dict[int, int], bool]:
    """Read every fd to its end, keeping the first `keep` bytes of each and counting all; False if `deadline`
    (a time.monotonic()) came first."""
    kept, total = {fd: bytearray() for fd in fds}, dict.fromkeys(fds, 0)
    with selectors.DefaultSelector() as selector:
        for fd in fds:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                return kept, total, False
            for key, _ in selector.select(timeout):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                total[key.fd] += len(chunk)
                kept[key.fd] += chunk[: max(0, keep - len(kept[key.fd]))]
    return kept, total, True
