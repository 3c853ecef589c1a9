"""The sandbox's init: run as a script, as root, as PID 1 of fresh mount/network/PID/IPC/UTS/cgroup namespaces.

`sandbox.py` starts it as `unshare --mount --net --pid ... --fork --kill-child -- PYTHON -I -S sandbox_init.py CONFIG`.
It builds a private root (a read-only tmpfs holding read-only bind mounts of the interpreter and the libraries it links,
a few device nodes and a fresh tmpfs /scratch), pivots into it and detaches the host's tree, then forks the snippet:
as an unprivileged uid with no capabilities, no_new_privs and resource limits, in /scratch. It waits at most the wall
time limit, kills every process of the namespace when that passes, and writes one JSON status line to `status_fd`.
When it exits, the kernel kills whatever the snippet left behind (a PID namespace dies with its PID 1).

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
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
LIMITS = {"address_space": resource.RLIMIT_AS, "cpu": resource.RLIMIT_CPU, "file_size": resource.RLIMIT_FSIZE,
          "open_files": resource.RLIMIT_NOFILE, "processes": resource.RLIMIT_NPROC, "core": resource.RLIMIT_CORE}

_libc = ctypes.CDLL(None, use_errno=True)


def _checked(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    encode = lambda text: None if text is None else text.encode()
    _checked(_libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
             f"mount {source} on {target}")


def _bind(path: str, root: str, flags: int) -> None:
    """Bind `path` at the same place under `root`, then remount that bind with `flags` (read-only and more)."""
    target = root + path
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()
    _mount(path, target, None, MS_BIND)  # not recursive: mounts below `path` stay out of the sandbox
    _mount(None, target, None, MS_BIND | MS_REMOUNT | flags)


def build_root(config: dict) -> None:
    """Make `config["root"]` the root of this mount namespace, with nothing of the host in it but what is bound."""
    root, uid, gid = config["root"], config["uid"], config["gid"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in config["read_only"]:
        _bind(path, root, MS_RDONLY | MS_NOSUID | MS_NODEV)
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


def exec_snippet(config: dict) -> None:
    """In the forked child: drop to the sandbox's uid with its limits, then exec the snippet's interpreter."""
    os.close(config["status_fd"])
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for name, value in config["limits"].items():
        soft, hard = value if isinstance(value, list) else (value, value)
        resource.setrlimit(LIMITS[name], (soft, hard))
    os.setgroups([])
    os.setgid(config["gid"])
    os.setuid(config["uid"])  # real, effective and saved: root's capabilities are gone for good
    _checked(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _checked(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "parent death signal")  # setuid cleared it
    os.chdir("/scratch")
    env = {"PATH": "/usr/bin:/bin", "HOME": "/scratch", "TMPDIR": "/scratch", "LANG": "C.UTF-8"}
    python = config["python"]
    # isolated (no environment variables, no user site), UTF-8 whatever the locale, no bytecode written
    os.execve(python, [python, "-I", "-X", "utf8", "-B", "main.py"], env)


def supervise(config: dict, child: int) -> dict:
    """Wait for the snippet at most `wall_s`, then kill every process in this PID namespace; its exit status."""
    pidfd = os.pidfd_open(child)
    timed_out = not select.select([pidfd], [], [], config["wall_s"])[0]
    if timed_out:
        os.kill(-1, signal.SIGKILL)  # from PID 1: every other process of the namespace, however it was started
    _, wait_status, usage = os.wait4(child, 0)
    return {"exit_code": os.waitstatus_to_exitcode(wait_status), "timed_out": timed_out,
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 3), "max_rss_kb": usage.ru_maxrss}


def main() -> None:
    config = json.loads(sys.argv[1])
    if os.getpid() != 1:  # not in a new PID namespace, so not in the new mount namespace either: touch no mount
        print("sandbox setup failed: the init is not PID 1 of new namespaces (was it started by unshare?)",
              file=sys.stderr)
        os._exit(125)
    try:
        build_root(config)
    except OSError as error:
        print(f"sandbox setup failed: {error}", file=sys.stderr)
        os._exit(125)
    # the child reports a failure before its exec here; a successful exec closes the pipe (close-on-exec) unwritten
    failure_read, failure_write = os.pipe2(os.O_CLOEXEC)
    child = os.fork()
    if child == 0:
        os.close(failure_read)
        try:
            exec_snippet(config)
        except BaseException as error:  # whatever failed, nothing runs unconfined after it
            os.write(failure_write, repr(error).encode())
        os._exit(126)
    os.close(failure_write)
    failure = os.read(failure_read, 4096).decode(errors="replace")
    status = supervise(config, child)
    status["setup_error"] = failure or None
    os.write(config["status_fd"], (json.dumps(status) + "\n").encode())
    os._exit(0)


if __name__ == "__main__":
    main()
