"""Run untrusted Python snippets, one fresh confined process each (Linux namespaces, a private root, a system call
filter, one resource budget per snippet); as root, or as any user where unprivileged user namespaces are enabled.

Each snippet runs as `python -I -S -X utf8 -B main.py` (the server's base interpreter, standard library only: its
site-packages are hidden and not loaded) under `sandbox_init.py`, which the server starts with an empty environment.
What the sandbox guarantees:

- **files**: the root is an empty read-only tmpfs holding read-only bind mounts of the interpreter's prefix (its
  site-packages covered by an empty directory) and the system libraries it links (`/usr/lib`, `/usr/lib64`, or `/lib*`
  where those are directories), `/dev/null`, `/dev/zero`, `/dev/random`, `/dev/urandom`, and `/scratch`, the working
  directory: a tmpfs of its own, empty when the snippet starts and gone when it ends. Nothing else of the host exists
  there: no `/etc`, `/tmp`, `/proc`, `/home`, no repository.
- **network**: a network namespace whose only interface (loopback) is down: no connection anywhere, loopback included.
- **processes**: a PID namespace of its own (it sees only its own processes, and can signal no other); when the
  snippet ends, or a limit is reached, every process it started is killed, even one that called setsid().
- **privileges**: as root, a uid of its own (`uid_base + slot`, a different one for each snippet running at the same
  time); as another user, that uid inside a user namespace of its own (mapped to the server's user), no capabilities
  in it. Either way `no_new_privs`, and the system call filter of `seccomp.py`: no new namespaces (so no capability
  over any kernel code), no keyrings (nothing persists between snippets through them), no io_uring, bpf,
  perf_event_open, mounts, ptrace, file locks or change notification.
- **one budget per snippet, for all its processes together**: memory `memory_mb` and `processes` processes in a cgroup
  of its own where the server can make one (root with cgroup v1 or v2, or a delegated cgroup v2 subtree; the kernel's
  OOM killer acts inside it); elsewhere each process gets `memory_mb / processes` of address space, so that together
  they stay within the budget (`processes` then defaults to `memory_mb / 64`). CPU time `cpu_s` summed over all the
  snippet's processes (and each one's own limit at `cpu_s`); wall time `wall_s`; files of at most `file_mb`; 64 open
  files per process; `/scratch` holds at most `scratch_mb`.

What it does not guarantee: it shares the host's kernel (a kernel bug reachable by the allowed calls is not
contained), and snippets running at the same time share the CPUs and can time each other.

Needs Linux >= 5.3 (x86_64 or aarch64), libseccomp, and either root or unprivileged user namespaces (most
distributions enable them; `user.max_user_namespaces` must be above 0, and Ubuntu's AppArmor may restrict them:
`kernel.apparmor_restrict_unprivileged_userns`). `Sandbox.check()` proves the confinement on this machine with a probe
snippet; the server refuses to start when it fails, naming what is missing.
"""

from __future__ import annotations

import json
import os
import platform
import queue
import selectors
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .cgroups import SnippetCgroups
from .sandbox_init import SYS_PIVOT_ROOT
from .seccomp import SeccompUnavailable, compile_filter

UID_BASE = 200000  # sandbox uids: UID_BASE .. UID_BASE + max_parallel - 1, owned by nothing on the host
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
LIBRARY_DIRS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32")
MAX_CODE_BYTES = 64 * 1024
OPEN_FILES, PROCESSES = 64, 16  # per process; processes per snippet where a cgroup counts them
MIN_PROCESS_MB = 64  # without a cgroup: the least address space a process gets when the budget is split
# the init's two processes (its host-side one and PID 1) are in the snippet's cgroup, and in a user namespace they
# share the snippet's uid, so they count against its process limit there
INIT_PROCESSES = 2
CANCEL_POLL_S = 0.1  # how soon a cancelled run is killed
GRACE_S = 5.0  # beyond wall_s, how long the server waits for the init before killing the run itself
INIT = Path(__file__).with_name("sandbox_init.py")
SYS_CALLS = {"x86_64": {"keyctl": 250, "io_uring_setup": 425}, "aarch64": {"keyctl": 219, "io_uring_setup": 425}}

PROBE = """
import ctypes, errno, json, os, socket
try:
    socket.create_connection(("127.0.0.1", 9), timeout=2).close()
    network = "connected"
except OSError as error:
    network = errno.errorcode.get(error.errno, str(error))
libc = ctypes.CDLL(None, use_errno=True)
def refused(result):
    return errno.errorcode.get(ctypes.get_errno(), "?") if result == -1 else "allowed"
print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "cwd": os.getcwd(), "root": sorted(os.listdir("/")),
                  "network": network, "user_namespace": refused(libc.unshare(0x10000000)),
                  "keyctl": refused(libc.syscall(%(keyctl)d, 0, -3, 0)),
                  "io_uring": refused(libc.syscall(%(io_uring_setup)d, 1, None))}))
"""

class SandboxUnavailable(RuntimeError):
    """The sandbox cannot confine snippets on this machine; the message says what is missing."""


class SandboxError(RuntimeError):
    """A run failed on the sandbox's side (its setup), not the snippet's."""


class SandboxCancelled(SandboxError):
    """A run was killed before its end because its client went away."""


@dataclass
class RunResult:
    """What one snippet did. `stdout`/`stderr` hold at most `keep_bytes` of each (`clipped` when either was longer;
    the `*_bytes` counts are whole); `exit_code` is negative for a signal (-24, SIGXCPU: over its CPU time);
    `timed_out`: killed at the wall-clock limit; `over_cpu`: killed when its processes together used more than the
    CPU time limit; `out_of_memory`: a process of it was killed by the kernel at the snippet's memory budget;
    `cpu_s`: the CPU time of all its processes."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    cpu_s: float | None
    stdout_bytes: int
    stderr_bytes: int
    clipped: bool
    wall_s: float
    over_cpu: bool = False
    out_of_memory: bool = False


class Sandbox:
    """Runs snippets confined as the module docstring says; at most `max_parallel` at a time (others wait).

    `processes` defaults to PROCESSES where a cgroup holds the snippet, else to `memory_mb / 64`; `budget` says which
    (`"cgroup v1"`, `"cgroup v2"`, or `"split between processes"`, with `budget_reason` saying why no cgroup).
    """

    def __init__(self, *, wall_s: float = 10.0, cpu_s: int = 5, memory_mb: int = 512, file_mb: int = 8,
                 scratch_mb: int = 16, max_parallel: int | None = None, processes: int | None = None,
                 keep_bytes: int = 64 * 1024, uid_base: int = UID_BASE):
        self.wall_s, self.cpu_s, self.memory_mb, self.file_mb = float(wall_s), int(cpu_s), memory_mb, file_mb
        self.scratch_mb, self.keep_bytes, self.uid_base = scratch_mb, keep_bytes, uid_base
        self.max_parallel = max_parallel or max(2, os.cpu_count() or 1)
        self.user_namespace = os.geteuid() != 0
        self._slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(self.max_parallel):
            self._slots.put(slot)
        self.python = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
        self.read_only, self.symlinks = _read_only_paths(self.python)
        self.hidden = _site_packages(self.read_only)
        self._dir = tempfile.mkdtemp(prefix="opd-sandbox-")  # mount points, the snippets' sources
        os.mkdir(os.path.join(self._dir, "root"))
        os.mkdir(os.path.join(self._dir, "proc"))
        self.cgroups, self.budget_reason = SnippetCgroups.create(
            self.max_parallel, memory_mb * 2**20, (processes or PROCESSES) + INIT_PROCESSES)
        self.budget = self.budget_reason if self.cgroups else "split between processes"
        self.processes = processes or (PROCESSES if self.cgroups else max(1, memory_mb // MIN_PROCESS_MB))
        self._filter: bytes | None = None

    @property
    def _init_processes(self) -> int:
        return INIT_PROCESSES if self.user_namespace else 0

    def uids(self) -> range:
        return range(self.uid_base, self.uid_base + self.max_parallel)

    def limits(self) -> dict:
        """What each snippet may use (for the server's start line and its metadata)."""
        return {"wall_s": self.wall_s, "cpu_s": self.cpu_s, "memory_mb": self.memory_mb,
                "processes": self.processes, "budget": self.budget, "file_mb": self.file_mb,
                "scratch_mb": self.scratch_mb, "max_parallel": self.max_parallel,
                "privileges": "user namespace" if self.user_namespace else "root, a uid per slot"}

    def close(self) -> None:
        if self.cgroups:
            self.cgroups.remove()
        shutil.rmtree(self._dir, ignore_errors=True)

    def check(self) -> None:
        """Raise SandboxUnavailable, saying what is missing, unless a probe snippet runs confined here: its own uid,
        /scratch as working directory, nothing of the host's tree in its root, no network, and no new namespace,
        keyring or io_uring."""
        machine = platform.machine()
        if not sys.platform.startswith("linux") or machine not in SYS_PIVOT_ROOT:
            raise SandboxUnavailable(f"The sandbox needs Linux on x86_64 or aarch64, not {sys.platform} {machine}.")
        if self.user_namespace and (reason := _user_namespaces_refused()):
            raise SandboxUnavailable(f"The sandbox needs root or unprivileged user namespaces, and {reason}.")
        if not self.cgroups and self.memory_mb // self.processes < MIN_PROCESS_MB // 2:
            raise SandboxUnavailable(
                f"Without a cgroup ({self.budget_reason}) each of a snippet's {self.processes} processes gets "
                f"{self.memory_mb // self.processes} MiB of its {self.memory_mb} MiB, too little for Python to start: "
                f"raise --memory-mb or lower --processes (to {max(1, self.memory_mb // MIN_PROCESS_MB)}, say).")
        try:
            self._filter = compile_filter()
            result = self.run(PROBE % SYS_CALLS[machine])
            seen = json.loads(result.stdout)
        except (SeccompUnavailable, SandboxError, ValueError) as error:
            raise SandboxUnavailable(f"The sandbox could not be set up on this machine: {error}") from error
        expected_root = sorted({path.split("/")[1] for path in [*self.read_only, *self.symlinks, *DEVICES]}
                               | {"scratch"})
        problems = [f"{what}: {seen[key]!r}, expected {want!r}" for what, key, want in (
            ("uid", "uid", f"one of {self.uid_base}..{self.uids()[-1]}"),
            ("working directory", "cwd", "/scratch"),
            ("root directory", "root", expected_root),
            ("connecting to loopback", "network", "ENETUNREACH"),
            ("a new user namespace", "user_namespace", "EPERM"),
            ("keyctl", "keyctl", "EPERM"),
            ("io_uring_setup", "io_uring", "EPERM"),
        ) if not (seen[key] in self.uids() if key == "uid" else seen[key] == want)]
        if problems:
            raise SandboxUnavailable("The sandbox does not confine snippets on this machine: " + "; ".join(problems))

    def run(self, code: str, cancel: threading.Event | None = None) -> RunResult:
        """Run `code` (at most 64 KiB of UTF-8) in a fresh sandbox, waiting for a free slot first; `cancel`, when
        set, kills the run (its client went away)."""
        source = code.encode("utf-8", errors="replace")
        if len(source) > MAX_CODE_BYTES:
            raise ValueError(f"The snippet is {len(source)} bytes; at most {MAX_CODE_BYTES} are run.")
        if self._filter is None:
            raise SandboxError("the sandbox was not checked: call check() before run()")
        slot = self._slots.get()
        try:
            return self._run(source, slot, cancel)
        finally:
            self._slots.put(slot)

    def _config(self, source_path: str, slot: int, status_fd: int) -> dict:
        mib = 2**20
        per_process = self.memory_mb if self.cgroups else self.memory_mb // self.processes
        return {
            "root": os.path.join(self._dir, "root"), "proc": os.path.join(self._dir, "proc"),
            "read_only": self.read_only, "hidden": self.hidden, "symlinks": self.symlinks,
            "devices": [device for device in DEVICES if os.path.exists(device)], "source": source_path,
            "uid": self.uid_base + slot, "gid": self.uid_base + slot, "python": self.python, "wall_s": self.wall_s,
            "cpu_s": self.cpu_s, "scratch_bytes": self.scratch_mb * mib, "status_fd": status_fd,
            "user_namespace": self.user_namespace, "seccomp": self._filter.hex(),
            "cgroups": self.cgroups.dirs[slot] if self.cgroups else [],
            "limits": {"address_space": per_process * mib, "cpu": [self.cpu_s, self.cpu_s + 1],
                       "file_size": self.file_mb * mib, "open_files": OPEN_FILES,
                       "processes": self.processes + self._init_processes, "core": 0},
        }

    def _run(self, source: bytes, slot: int, cancel: threading.Event | None) -> RunResult:
        fd, source_path = tempfile.mkstemp(dir=self._dir, suffix=".py")
        with os.fdopen(fd, "wb") as file:
            file.write(source)
        status_read, status_write = os.pipe()
        oom_before = self.cgroups.oom_kills(slot) if self.cgroups else 0
        start = time.monotonic()
        try:
            config = self._config(source_path, slot, status_write)
            command = [self.python, "-I", "-S", str(INIT), json.dumps(config)]
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, pass_fds=(status_write,), start_new_session=True,
                                       env={})  # the server's environment (its secrets) stays out
            os.close(status_write)
            status_write = None
            streams = [process.stdout.fileno(), process.stderr.fileno(), status_read]
            finished = False
            try:
                kept, total, finished = _drain(streams, self.keep_bytes, start + self.wall_s + GRACE_S, cancel)
            finally:
                if not finished:  # the init did not end the run in time, reading failed, or it was cancelled
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                process.stdout.close()
                process.stderr.close()
        finally:
            os.unlink(source_path)
            os.close(status_read)
            if status_write is not None:
                os.close(status_write)
        if cancel is not None and cancel.is_set() and not finished:
            raise SandboxCancelled("the run was cancelled: its client went away")
        stdout, stderr, status = (bytes(kept[fd]) for fd in streams)
        stderr_text = stderr.decode("utf-8", errors="replace")
        if finished and not status:
            raise SandboxError(f"the sandbox's init ended ({process.returncode}) without a status: {stderr_text}")
        status = json.loads(status) if status else {"exit_code": None, "timed_out": True, "cpu_s": None}
        if status.get("setup_error"):
            raise SandboxError(f"the snippet could not be started: {status['setup_error']}")
        out_of_memory = bool(self.cgroups) and self.cgroups.oom_kills(slot) > oom_before
        return RunResult(stdout.decode("utf-8", errors="replace"), stderr_text, status["exit_code"],
                         status["timed_out"], status["cpu_s"], total[streams[0]], total[streams[1]],
                         max(total[streams[0]], total[streams[1]]) > self.keep_bytes, time.monotonic() - start,
                         over_cpu=bool(status.get("over_cpu")), out_of_memory=out_of_memory)


# the settings that refuse unprivileged user namespaces: path -> (the refusing value, what it means)
USERNS_SETTINGS = {
    "/proc/sys/user/max_user_namespaces": ("0", "user.max_user_namespaces is 0"),
    "/proc/sys/kernel/unprivileged_userns_clone": ("0", "kernel.unprivileged_userns_clone is 0"),
    "/proc/sys/kernel/apparmor_restrict_unprivileged_userns":
        ("1", "AppArmor restricts them (kernel.apparmor_restrict_unprivileged_userns is 1)"),
}


def _user_namespaces_refused() -> str | None:
    """Why this machine refuses unprivileged user namespaces, or None where it allows them."""
    for path, (refusing, reason) in USERNS_SETTINGS.items():
        try:
            with open(path) as file:
                if file.read().strip() == refusing:
                    return f"{reason}: run the server as root (e.g. in its own container), or ask the machine's " \
                           "administrator to allow unprivileged user namespaces"
        except OSError:
            continue
    return None


def _site_packages(binds: list[str]) -> list[str]:
    """The interpreter's site-packages directories that the sandbox's binds would show (covered by empty ones)."""
    found = {os.path.realpath(path) for path in site.getsitepackages([sys.base_prefix])}
    return sorted(path for path in found if os.path.isdir(path) and any(path.startswith(b + "/") for b in binds))


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


def _drain(fds: list[int], keep: int, deadline: float, cancel: threading.Event | None = None
           ) -> tuple[dict[int, bytearray], dict[int, int], bool]:
    """Read every fd to its end, keeping the first `keep` bytes of each and counting all; False if `deadline`
    (a time.monotonic()) came first or `cancel` was set."""
    kept, total = {fd: bytearray() for fd in fds}, dict.fromkeys(fds, 0)
    with selectors.DefaultSelector() as selector:
        for fd in fds:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            timeout = deadline - time.monotonic()
            if timeout <= 0 or (cancel is not None and cancel.is_set()):
                return kept, total, False
            for key, _ in selector.select(min(timeout, CANCEL_POLL_S)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                total[key.fd] += len(chunk)
                kept[key.fd] += chunk[: max(0, keep - len(kept[key.fd]))]
    return kept, total, True
