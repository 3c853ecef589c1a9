"""The sandbox's init: run as a script (`python -I -S sandbox_init.py CONFIG`, an empty environment) for each snippet.

It joins the snippet's cgroups, if any, then unshares mount, network, PID, IPC, UTS and cgroup namespaces (and, when
not root, a user namespace first, which is what lets an unprivileged user do the rest) and forks PID 1 of the new PID
namespace. PID 1 builds a private root (a read-only tmpfs holding read-only bind mounts of the interpreter and the
libraries it links, its site-packages hidden, a few device nodes and a fresh tmpfs /scratch), pivots into it and
detaches the host's tree, then forks the snippet: a uid of its own (as root) or no capabilities at all (in a user
namespace), no_new_privs, resource limits and the system call filter (`seccomp.py`), in /scratch. PID 1 counts the
CPU time of every process of the namespace (through a procfs of its own, outside the snippet's root), kills them all
at the CPU budget or the wall time, and writes one JSON status line to `status_fd`. When it exits, the kernel kills
whatever the snippet left behind (a PID namespace dies with its PID 1).

Standard library only, no site packages: it runs before (and outside) any sandbox, with the host's interpreter.
"""

import ctypes
import json
import os
import platform
import resource
import select
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
PR_SET_SECCOMP, SECCOMP_MODE_FILTER, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 22, 2, 47, 4
CAPABILITY_VERSION_3 = 0x20080522
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
SYS_CAPSET = {"x86_64": 126, "aarch64": 91}
CPU_POLL_S = 0.02  # how often PID 1 adds up the namespace's CPU time
LIMITS = {"address_space": resource.RLIMIT_AS, "cpu": resource.RLIMIT_CPU, "file_size": resource.RLIMIT_FSIZE,
          "open_files": resource.RLIMIT_NOFILE, "processes": resource.RLIMIT_NPROC, "core": resource.RLIMIT_CORE}

_libc = ctypes.CDLL(None, use_errno=True)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _checked(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    encode = lambda text: None if text is None else text.encode()
    _checked(_libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
             f"mount {source} on {target}")


def _kept_flags(path: str) -> int:
    """The flags of the mount holding `path` that a bind remount must keep (in a user namespace the kernel refuses
    to clear them)."""
    flags = os.statvfs(path).f_flag
    kept = {os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC, os.ST_NOATIME: MS_NOATIME,
            os.ST_NODIRATIME: MS_NODIRATIME, os.ST_RELATIME: MS_RELATIME}
    return sum(ms for st, ms in kept.items() if flags & st)


def _bind(path: str, root: str, flags: int) -> None:
    """Bind `path` at the same place under `root`, then remount that bind with `flags` (read-only and more)."""
    target = root + path
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()
    _mount(path, target, None, MS_BIND)  # not recursive: mounts below `path` stay out of the sandbox
    _mount(None, target, None, MS_BIND | MS_REMOUNT | flags | _kept_flags(path))


def enter_namespaces(config: dict) -> None:
    """Join the snippet's cgroups, then unshare its namespaces; in a user namespace, map the snippet's uid and gid to
    this user's own (the only ids an unprivileged user may map)."""
    for directory in config["cgroups"]:
        with open(os.path.join(directory, "cgroup.procs"), "w") as procs:
            procs.write(str(os.getpid()))
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
    _checked(_libc.unshare(flags | (CLONE_NEWUSER if config["user_namespace"] else 0)), "unshare")
    if config["user_namespace"]:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{config['uid']} {uid} 1"),
                           ("gid_map", f"{config['gid']} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as file:
                file.write(text)


def build_root(config: dict) -> int:
    """Make `config["root"]` the root of this mount namespace, with nothing of the host in it but what is bound; the
    namespace's own procfs stays open (the returned fd) for PID 1, outside that root."""
    root, uid, gid = config["root"], config["uid"], config["gid"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates to the host
    _mount("proc", config["proc"], "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    proc = os.open(config["proc"], os.O_RDONLY | os.O_DIRECTORY)  # not inherited: Python's fds are close-on-exec
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in config["read_only"]:
        _bind(path, root, MS_RDONLY | MS_NOSUID | MS_NODEV)
    for path in config["hidden"]:  # the interpreter's site-packages: the snippet gets the standard library only
        _mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555")
    for path in config["devices"]:
        _bind(path, root, MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    for link, target in config["symlinks"].items():
        os.symlink(target, root + link)
    scratch = root + "/scratch"
    os.mkdir(scratch)
    _mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
           f"size={config['scratch_bytes']},nr_inodes=1024,mode=0700,uid={uid},gid={gid}")
    with open(config["source"], "rb") as source, open(scratch + "/main.py", "wb") as copy:
        copy.write(source.read())
    os.chown(scratch + "/main.py", uid, gid)
    os.chdir(root)
    _checked(_libc.syscall(SYS_PIVOT_ROOT[platform.machine()], b".", b"."), "pivot_root")
    _checked(_libc.umount2(b".", MNT_DETACH), "detaching the host's root")  # the old root was stacked on ours
    os.chdir("/")
    _mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return proc


def drop_capabilities(last_capability: int) -> None:
    """No capability left, none to regain: bounding and ambient sets cleared, then every set emptied."""
    for capability in range(last_capability + 1):
        _checked(_libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0), f"dropping capability {capability}")
    _checked(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clearing ambient capabilities")
    header = (ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: twice (capabilities 0-31, 32-63), all 0
    _checked(_libc.syscall(SYS_CAPSET[platform.machine()], header, data), "capset")


def install_filter(program: bytes) -> None:
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    _checked(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp filter")


def exec_snippet(config: dict, last_capability: int) -> None:
    """In the forked child: drop every privilege, set the limits and the filter, then exec the snippet."""
    os.close(config["status_fd"])
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for name, value in config["limits"].items():
        soft, hard = value if isinstance(value, list) else (value, value)
        resource.setrlimit(LIMITS[name], (soft, hard))
    if config["user_namespace"]:
        drop_capabilities(last_capability)  # the snippet's uid is already its own, mapped to this user's
    else:
        os.setgroups([])
        os.setgid(config["gid"])
        os.setuid(config["uid"])  # real, effective and saved: root's capabilities are gone for good
    _checked(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _checked(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "parent death signal")  # setuid cleared it
    os.chdir("/scratch")
    env = {"PATH": "/usr/bin:/bin", "HOME": "/scratch", "TMPDIR": "/scratch", "LANG": "C.UTF-8"}
    python = config["python"]
    install_filter(bytes.fromhex(config["seccomp"]))  # last: execve is allowed, the calls above might not be
    # isolated (no environment variables, no user site), no site packages, UTF-8 whatever the locale, no bytecode
    os.execve(python, [python, "-I", "-S", "-X", "utf8", "-B", "main.py"], env)


def namespace_cpu_s(proc: int, reaped: float) -> float:
    """CPU seconds used by the namespace's processes: those alive (with the children each has waited for) from its
    procfs, plus `reaped`, what PID 1 has collected of those that ended."""
    ticks, total = os.sysconf("SC_CLK_TCK"), reaped
    for name in os.listdir(proc):
        if not name.isdigit() or name == "1":
            continue
        try:
            with open(f"{name}/stat", opener=lambda path, flags: os.open(path, flags, dir_fd=proc)) as file:
                fields = file.read().rsplit(")", 1)[1].split()
        except OSError:  # it ended while being read: its time is in a parent's children's time, or in `reaped`
            continue
        total += sum(int(value) for value in fields[11:15]) / ticks  # utime, stime, cutime, cstime
    return total


def supervise(config: dict, child: int, proc: int) -> dict:
    """Wait for the snippet at most `wall_s`, and its namespace's CPU time at most `cpu_s`; then kill every process
    in this PID namespace. Its exit status, and whether a limit ended it."""
    pidfd = os.pidfd_open(child)
    deadline = os.times().elapsed + config["wall_s"]
    cpu_budget, timed_out, over_cpu = config["cpu_s"], False, False
    while not select.select([pidfd], [], [], CPU_POLL_S)[0]:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        if namespace_cpu_s(proc, usage.ru_utime + usage.ru_stime) > cpu_budget:
            over_cpu = True
        elif os.times().elapsed >= deadline:
            timed_out = True
        else:
            continue
        break
    # from PID 1: every other process of the namespace, however it was started; nothing outlives the snippet
    os.kill(-1, signal.SIGKILL)
    _, wait_status, _ = os.wait4(child, 0)
    while True:  # reap the rest, so that their CPU time is counted
        try:
            os.wait4(-1, 0)
        except ChildProcessError:
            break
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"exit_code": os.waitstatus_to_exitcode(wait_status), "timed_out": timed_out, "over_cpu": over_cpu,
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 3), "max_rss_kb": usage.ru_maxrss}


def run_pid1(config: dict) -> None:
    """PID 1 of the snippet's namespaces: build the root, start the snippet, supervise it, report."""
    _checked(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "parent death signal")
    # not traceable by the snippet (same uid in a user namespace); a signal it has no handler for cannot reach it
    _checked(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "not dumpable")
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    with open("/proc/sys/kernel/cap_last_cap") as file:
        last_capability = int(file.read())
    try:
        proc = build_root(config)
    except OSError as error:
        print(f"sandbox setup failed: {error}", file=sys.stderr)
        os._exit(125)
    # the child reports a failure before its exec here; a successful exec closes the pipe (close-on-exec) unwritten
    failure_read, failure_write = os.pipe2(os.O_CLOEXEC)
    child = os.fork()
    if child == 0:
        os.close(failure_read)
        try:
            exec_snippet(config, last_capability)
        except BaseException as error:  # whatever failed, nothing runs unconfined after it
            os.write(failure_write, repr(error).encode())
        os._exit(126)
    os.close(failure_write)
    failure = os.read(failure_read, 4096).decode(errors="replace")
    status = supervise(config, child, proc)
    status["setup_error"] = failure or None
    os.write(config["status_fd"], (json.dumps(status) + "\n").encode())
    os._exit(0)


def main() -> None:
    config = json.loads(sys.argv[1])
    _checked(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "parent death signal")  # the server's thread
    try:
        enter_namespaces(config)
    except OSError as error:
        print(f"sandbox setup failed: {error}", file=sys.stderr)
        os._exit(125)
    pid1 = os.fork()  # the first child in a new PID namespace is its PID 1
    if pid1 == 0:
        run_pid1(config)
    _, wait_status = os.waitpid(pid1, 0)
    os._exit(os.waitstatus_to_exitcode(wait_status) & 0xFF)


if __name__ == "__main__":
    main()
