"""The sandbox's system call filter, compiled once by the server with libseccomp (through ctypes) into the raw BPF
program that `sandbox_init.py` installs in each snippet just before it runs.

What it refuses, and why (every other call is allowed; namespaces, limits and the private root do the rest):
- new namespaces and joining others (`unshare`, `setns`, `clone` with a namespace flag; `clone3`, whose flags the
  filter cannot read, answers ENOSYS so that the C library falls back to `clone`): a user namespace of its own would
  give the snippet capabilities over the kernel's namespaced code (mounts, netfilter), the entry point of most
  container escapes;
- kernel keyrings (`add_key`, `request_key`, `keyctl`): a uid's keyring outlives the process that wrote it, so one
  snippet could leave data for a later one;
- `io_uring_*`, `bpf`, `perf_event_open`, `userfaultfd`: large kernel attack surface no snippet needs;
- mounting, `pivot_root`, `chroot`, file handles (`open_by_handle_at`), `ptrace` and `process_vm_*`;
- file locks and change notification (`flock`, `fcntl`'s lock, lease and notify commands, `inotify_init*`,
  `fanotify_init`): snippets running at the same time read the same interpreter files, and a lock or a watch on one
  of them would be a channel between them. Locks answer ENOLCK ("no locks available"), so a program that uses them
  is told, never silently unlocked.

Denied calls fail with EPERM (ENOSYS for `clone3`, ENOLCK for locks); a call from another architecture's ABI (x32,
i386) kills the process (libseccomp's default for a foreign architecture).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

ALLOW = 0x7FFF0000  # SCMP_ACT_ALLOW
CMP_EQ, CMP_MASKED_EQ = 4, 7  # enum scmp_compare
NAMESPACE_FLAGS = {  # CLONE_NEW*: clone's first argument, on x86_64 and aarch64 alike
    "CLONE_NEWTIME": 0x80, "CLONE_NEWNS": 0x20000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
DENIED = (
    "unshare", "setns", "add_key", "request_key", "keyctl", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "bpf", "perf_event_open", "userfaultfd", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "name_to_handle_at", "open_by_handle_at", "ptrace",
    "process_vm_readv", "process_vm_writev", "inotify_init", "inotify_init1", "fanotify_init",
)
LOCKED = ("flock",)
# fcntl commands: F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW, F_SETLEASE, F_NOTIFY
FCNTL_LOCKS = (5, 6, 7, 36, 37, 38, 1024, 1026)


class SeccompUnavailable(RuntimeError):
    """libseccomp is missing or refused to build the filter; the message says how to get it."""


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO(code)


def _library():
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        library = ctypes.CDLL(name, use_errno=True)
    except OSError as error:
        raise SeccompUnavailable(f"libseccomp was not found ({error}): the sandbox filters each snippet's system "
                                 "calls with it. Install it (Debian/Ubuntu: apt-get install libseccomp2; "
                                 "Fedora/RHEL: dnf install libseccomp).") from error
    library.seccomp_init.restype = ctypes.c_void_p
    library.seccomp_init.argtypes = [ctypes.c_uint32]
    library.seccomp_release.argtypes = [ctypes.c_void_p]
    library.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    library.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                               ctypes.POINTER(_ArgCmp)]
    library.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return library


def compile_filter(denied: tuple[str, ...] = DENIED, *, whole: bool = True) -> bytes:
    """The filter as a raw BPF program (an array of `struct sock_filter`) for this machine's architecture: `denied`
    answer EPERM; `whole` adds the rules on clone's flags, clone3, locks and notification."""
    library = _library()
    context = library.seccomp_init(ALLOW)
    if not context:
        raise SeccompUnavailable("libseccomp could not create a filter (seccomp_init failed)")
    try:
        def rule(name: str, action: int, *comparisons: _ArgCmp) -> None:
            number = library.seccomp_syscall_resolve_name(name.encode())
            if number < 0:  # a call this architecture does not have (inotify_init on aarch64): nothing to deny
                return
            array = (_ArgCmp * len(comparisons))(*comparisons) if comparisons else None
            result = library.seccomp_rule_add_array(context, action, number, len(comparisons), array)
            if result != 0:
                raise SeccompUnavailable(f"libseccomp refused the rule for {name}: {os.strerror(-result)}")

        for name in denied:
            rule(name, _errno_action(errno.EPERM))
        for flag in NAMESPACE_FLAGS.values() if whole else ():
            rule("clone", _errno_action(errno.EPERM), _ArgCmp(0, CMP_MASKED_EQ, flag, flag))
        if whole:
            rule("clone3", _errno_action(errno.ENOSYS))
            for name in LOCKED:
                rule(name, _errno_action(errno.ENOLCK))
            for command in FCNTL_LOCKS:
                rule("fcntl", _errno_action(errno.ENOLCK), _ArgCmp(1, CMP_EQ, command, 0))
        read, write = os.pipe()
        try:
            result = library.seccomp_export_bpf(context, write)
            os.close(write)
            write = None
            if result != 0:
                raise SeccompUnavailable(f"libseccomp could not export the filter: {os.strerror(-result)}")
            program = b"".join(iter(lambda: os.read(read, 1 << 16), b""))
        finally:
            os.close(read)
            if write is not None:
                os.close(write)
    finally:
        library.seccomp_release(context)
    if not program or len(program) % 8:
        raise SeccompUnavailable(f"libseccomp exported a filter of {len(program)} bytes, not whole instructions")
    return program
