"""One memory and process budget for all of a snippet's processes: a cgroup per sandbox slot, v1 or v2.

`SnippetCgroups.create(slots, memory_bytes, processes)` makes, under the server's own cgroup, `opd-sandbox-<pid>/
slot-<n>` with the memory limit (swap included where the host accounts it) and the process limit; a snippet's init
joins its slot's cgroup before it starts anything, so every process the snippet makes is counted against the one
budget, and the kernel's OOM killer acts inside it. It returns None, with the reason, where no cgroup can be written:
not root and no delegated cgroup v2 subtree, no memory or pids controller, or a v2 cgroup that holds processes and so
cannot give controllers to children. The sandbox then splits the budget between the processes it allows.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

CONTROLLERS = ("memory", "pids")


@dataclass
class SnippetCgroups:
    """The slots' cgroups: `dirs[slot]` lists the directories a snippet's init joins (one per v1 controller, one for
    v2); `version` is 1 or 2."""

    version: int
    parents: list[str]
    dirs: list[list[str]]

    @classmethod
    def create(cls, slots: int, memory_bytes: int, processes: int) -> tuple[SnippetCgroups | None, str]:
        """The slots' cgroups, or None and why not."""
        try:
            found = _v1_dirs() or _v2_dir()
        except OSError as error:
            return None, f"the cgroups could not be read ({error})"
        if isinstance(found, str):
            return None, found
        version = 1 if isinstance(found, dict) else 2
        name, parents = f"opd-sandbox-{os.getpid()}", []
        try:
            if version == 1:
                for controller in CONTROLLERS:
                    os.mkdir(os.path.join(found[controller], name))
                    parents.append(os.path.join(found[controller], name))
                dirs = []
                for slot in range(slots):
                    memory, pids = (os.path.join(parent, f"slot-{slot}") for parent in parents)
                    os.mkdir(memory)
                    os.mkdir(pids)
                    _write(memory, "memory.limit_in_bytes", memory_bytes)
                    if os.path.exists(os.path.join(memory, "memory.memsw.limit_in_bytes")):
                        _write(memory, "memory.memsw.limit_in_bytes", memory_bytes)
                    _write(pids, "pids.max", processes)
                    dirs.append([memory, pids])
            else:
                controllers = " ".join(f"+{c}" for c in CONTROLLERS)
                _write(found, "cgroup.subtree_control", controllers)  # so that our child may have them
                parent = os.path.join(found, name)
                os.mkdir(parent)
                parents.append(parent)
                _write(parent, "cgroup.subtree_control", controllers)
                dirs = []
                for slot in range(slots):
                    path = os.path.join(parent, f"slot-{slot}")
                    os.mkdir(path)
                    _write(path, "memory.max", memory_bytes)
                    if os.path.exists(os.path.join(path, "memory.swap.max")):
                        _write(path, "memory.swap.max", 0)
                    _write(path, "pids.max", processes)
                    dirs.append([path])
        except OSError as error:
            cls(version, parents, []).remove()
            return None, f"a cgroup v{version} could not be made for the snippets ({error})"
        return cls(version, parents, dirs), f"cgroup v{version}"

    def oom_kills(self, slot: int) -> int:
        """How many processes the kernel's OOM killer ended in this slot's cgroup so far."""
        memory = self.dirs[slot][0]
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            with open(os.path.join(memory, name)) as file:
                fields = dict(line.split() for line in file if line.strip())
        except OSError:
            return 0
        return int(fields.get("oom_kill", 0))

    def remove(self) -> None:
        """Remove the cgroups (each is empty once its snippet's namespace is gone; a moment's retry for the kernel)."""
        for parent in self.parents:
            for attempt in range(20):
                try:
                    for child in os.listdir(parent):
                        if os.path.isdir(os.path.join(parent, child)):
                            os.rmdir(os.path.join(parent, child))
                    os.rmdir(parent)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05 * (attempt + 1))


def _write(directory: str, name: str, value) -> None:
    with open(os.path.join(directory, name), "w") as file:
        file.write(str(value))


def _mounts() -> list[tuple[str, str, list[str]]]:
    """(mount point, filesystem type, super options) of each cgroup mount."""
    found = []
    with open("/proc/self/mountinfo") as file:
        for line in file:
            fields = line.split()
            separator = fields.index("-")
            fstype, options = fields[separator + 1], fields[separator + 3].split(",")
            if fstype in ("cgroup", "cgroup2"):
                found.append((fields[4], fstype, options))
    return found


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path by controller list ("memory", "pids", ... or "" for v2)."""
    paths = {}
    with open("/proc/self/cgroup") as file:
        for line in file:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path
    return paths


def _v1_dirs() -> dict[str, str] | None:
    """This process's v1 memory and pids cgroup directories, if both controllers are mounted and writable here."""
    own = _own_cgroups()
    dirs = {}
    for controller in CONTROLLERS:
        mounts = [point for point, fstype, options in _mounts() if fstype == "cgroup" and controller in options]
        if not mounts or controller not in own:
            return None
        dirs[controller] = os.path.join(mounts[0], own[controller].lstrip("/"))
    return dirs if all(os.access(path, os.W_OK) for path in dirs.values()) else None


def _v2_dir() -> str:
    """This process's v2 cgroup directory where it can give the memory and pids controllers to new children; else a
    string saying why not."""
    mounts = [point for point, fstype, _ in _mounts() if fstype == "cgroup2"]
    own = _own_cgroups().get("")
    if not mounts or own is None:
        return "no cgroup v2 is mounted and no writable v1 memory and pids controllers"
    path = os.path.join(mounts[0], own.lstrip("/"))
    with open(os.path.join(path, "cgroup.controllers")) as file:
        available = file.read().split()
    if missing := [c for c in CONTROLLERS if c not in available]:
        return f"the cgroup v2 at {path} does not offer the {' and '.join(missing)} controller(s)"
    if not os.access(path, os.W_OK):
        return f"the cgroup v2 at {path} is not writable by this user (no delegated subtree)"
    with open(os.path.join(path, "cgroup.procs")) as file:
        if own != "/" and file.read().strip():
            return (f"the cgroup v2 at {path} holds processes, so it cannot give controllers to a child cgroup "
                    "(run the server in a cgroup of its own, e.g. `systemd-run --user --scope -p Delegate=yes`)")
    return path
