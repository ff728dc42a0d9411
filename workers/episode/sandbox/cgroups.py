"""A cgroup per call (level ``sandbox``, as root): the memory of all the call's processes
together (``memory_mb``; the OOM killer acts inside the group, never on the node), their number
(``processes``) and, where the kernel has a weight for it, a low I/O weight. cgroup v2 (the
unified hierarchy, its controllers enabled for our groups) or v1 (one hierarchy per controller);
each call's group is ``PARENT/<pid namespace>-<server pid>-<keeper pid>`` under the tool
server's own cgroup, in each hierarchy used.

The keeper makes the group (``create``), the tool process moves itself in first thing
(``join``: its children follow), the server asks whether the kernel OOM-killed in it
(``oom_killed``) and removes it after the call (``remove``: what is left killed, rmdir retried);
a new tool server removes what servers no longer running left (``sweep``). ``probe_here`` finds
what works here. Standard library only."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .paths import Limits
    from .protections import Protections

PARENT = "rollcall-tools"  # under the server's own cgroup: every call's group in it
V2_CONTROLLERS = ("memory", "pids", "io")  # (io where the kernel has it)
V1_CONTROLLERS = ("memory", "pids", "blkio")
IO_WEIGHT = 50  # v2 io.weight (1..10000, default 100); v1 blkio.weight/blkio.bfq.weight: 10..1000
REMOVE_WAIT_S = 2.0  # how long a group's rmdir is retried (a dying pid namespace's processes)


# -- where: the hierarchies and the server's place in them ----------------------------------


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """cgroup mounts: (mount point, root, fs type, super options)."""
    out = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            head, _, tail = line.partition(" - ")
            fields, rest = head.split(), tail.split()
            if len(fields) >= 5 and len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2"):
                out.append((fields[4], fields[3], rest[0], set(rest[2].split(","))))
    return out


def _own() -> dict[str, str]:
    """This process's cgroup per controller ("" for v2's)."""
    out = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, names, path = line.split(":", 2)
            for name in names.split(",") if names else [""]:
                out[name] = path
    return out


def _under(mount: str, root: str, path: str) -> str | None:
    """The directory of cgroup ``path`` in a hierarchy mounted at ``mount`` from ``root``."""
    if root != "/" and not (path == root or path.startswith(root.rstrip("/") + "/")):
        return None
    rel = path[len(root) :] if root != "/" else path
    return os.path.join(mount, rel.lstrip("/"))  # noqa: PTH118


def locate() -> tuple[str, dict[str, str], str]:
    """(version, {controller: its directory of the server's cgroup}, why not): v2 if the
    unified hierarchy has memory and pids, else v1 with memory and pids mounted."""
    mounts, own = _mounts(), _own()
    why = "no cgroup hierarchy with the memory and pids controllers"
    for mount, root, fstype, _ in mounts:
        if fstype == "cgroup2" and "" in own:
            where = _under(mount, root, own[""])
            if where is None:
                continue
            try:
                have = Path(where, "cgroup.controllers").read_text().split()
            except OSError:
                continue
            if {"memory", "pids"} <= set(have):
                return "v2", {c: where for c in V2_CONTROLLERS if c in have}, ""
            why = f"cgroup v2 without memory and pids here ({' '.join(have) or 'none'})"
    dirs = {}
    for mount, root, fstype, options in mounts:
        for c in V1_CONTROLLERS:
            if fstype == "cgroup" and c in options and c in own and c not in dirs:
                where = _under(mount, root, own[c])
                weights = ("blkio.weight", "blkio.bfq.weight")
                if c == "blkio" and not any(Path(where or "/", f).exists() for f in weights):
                    continue  # (throttling only: nothing to set without a device and a rate)
                if where is not None and Path(where).is_dir():
                    dirs[c] = where
    if "memory" in dirs and "pids" in dirs:
        return "v1", dirs, ""
    return "none", {}, why


# -- a call's group -------------------------------------------------------------------------


def _pid_namespace() -> int:
    try:
        return Path("/proc/self/ns/pid").stat().st_ino
    except OSError:
        return 0


# the groups' names start with it: servers of other pid namespaces (containers sharing a
# hierarchy) have pids of their own, and their groups are not ours to sweep
_PIDNS = _pid_namespace()


def call_name(server: int, keeper: int) -> str:
    return f"{_PIDNS}-{server}-{keeper}"


def _dirs(plan: Protections, name: str) -> list[str]:
    """The call's group, one directory per hierarchy (v2: one)."""
    return sorted({os.path.join(p, name) for p in plan.cgroup_parents})  # noqa: PTH118


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def create(plan: Protections, name: str, limits: Limits) -> list[str]:
    """In the keeper: make the call's group with its limits; its directories (for ``join``).
    OSError if a limit cannot be set (the call then fails: the probe found it possible)."""
    dirs = _dirs(plan, name)
    for d in dirs:
        with contextlib.suppress(FileExistsError):
            os.mkdir(d)  # noqa: PTH102
    memory = limits.memory_mb * 1024 * 1024
    for d in dirs:
        p = Path(d)
        if plan.cgroup == "v2":
            if memory > 0:
                _write(f"{d}/memory.max", str(memory))
                if (p / "memory.swap.max").exists():
                    _write(f"{d}/memory.swap.max", "0")
                _write(f"{d}/memory.oom.group", "1")  # an OOM kill ends the whole call
            if limits.processes > 0:
                _write(f"{d}/pids.max", str(limits.processes))
            if (p / "io.weight").exists():
                with contextlib.suppress(OSError):  # best effort
                    _write(f"{d}/io.weight", f"default {IO_WEIGHT}")
        elif (p / "memory.limit_in_bytes").exists():
            if memory > 0:
                _write(f"{d}/memory.limit_in_bytes", str(memory))
                if (p / "memory.memsw.limit_in_bytes").exists():  # no swap past it either
                    with contextlib.suppress(OSError):  # (swap accounting off)
                        _write(f"{d}/memory.memsw.limit_in_bytes", str(memory))
        elif (p / "pids.max").exists():
            if limits.processes > 0:
                _write(f"{d}/pids.max", str(limits.processes))
        else:  # blkio: a weight where the I/O scheduler has one (best effort)
            for f in ("blkio.weight", "blkio.bfq.weight"):
                if (p / f).exists():
                    with contextlib.suppress(OSError):
                        _write(f"{d}/{f}", str(IO_WEIGHT))
    return dirs


def join(dirs: list[str]) -> None:
    """In the tool process, first thing: move itself into the call's group (its children
    then are born in it)."""
    for d in dirs:
        _write(f"{d}/cgroup.procs", "0")


def oom_killed(plan: Protections, name: str) -> bool:
    """Whether the kernel OOM-killed a process of the call's group (its memory limit)."""
    for d in _dirs(plan, name):
        for f in ("memory.events", "memory.oom_control"):
            with contextlib.suppress(OSError, ValueError):
                for line in Path(d, f).read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and int(value) > 0:
                        return True
    return False


def remove(plan: Protections, name: str, wait_s: float = REMOVE_WAIT_S) -> bool:
    """After the call: kill what is left in the group and remove it, retried ``wait_s``
    (processes of a dying pid namespace take a moment to leave it); whether it is gone."""
    return all([_remove(d, wait_s) for d in _dirs(plan, name)])


def _remove(d: str, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    pause = 0.001
    while True:
        try:
            os.rmdir(d)  # noqa: PTH106
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                return False
        with contextlib.suppress(OSError):
            if Path(d, "cgroup.kill").exists():  # (v2, 5.14+)
                _write(f"{d}/cgroup.kill", "1")
            for pid in Path(d, "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    os.kill(int(pid), signal.SIGKILL)
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def sweep(plan: Protections) -> list[str]:
    """Remove the groups that tool servers no longer running left; what was removed."""
    removed = []
    for parent in plan.cgroup_parents:
        with contextlib.suppress(OSError):
            for entry in Path(parent).iterdir():
                pidns, server, keeper = ([*entry.name.split("-"), "", ""])[:3]
                if pidns != str(_PIDNS) or not (server.isdigit() and keeper.isdigit()):
                    continue
                try:
                    os.kill(int(server), 0)
                    continue  # its server runs
                except ProcessLookupError:
                    pass
                except OSError:
                    continue
                if _remove(str(entry), REMOVE_WAIT_S):
                    removed.append(str(entry))
    return removed


# -- what works here ------------------------------------------------------------------------


def probe_here(root: bool) -> dict[str, Any]:
    """In the probe (single-threaded): make the parent group in each hierarchy, a group with
    limits in it, move a forked child in, remove it. The ``Protections`` fields."""
    none: dict[str, Any] = {"cgroup": "none", "cgroup_parents": (), "cgroup_controllers": ()}
    if not root:
        return {**none, "cgroup_error": "not root (a delegated cgroup is not used)"}
    version, dirs, why = locate()
    if version == "none":
        return {**none, "cgroup_error": why}
    try:
        parents = []
        for c, where in dirs.items():
            parent = os.path.join(where, PARENT)  # noqa: PTH118
            with contextlib.suppress(FileExistsError):
                os.mkdir(parent)  # noqa: PTH102
            if version == "v2":  # controllers for the parent's and its children's groups
                enable = " ".join(f"+{c}" for c in dirs)
                for d in (where, parent):
                    have = Path(d, "cgroup.subtree_control").read_text().split()
                    if not set(dirs) <= set(have):
                        _write(f"{d}/cgroup.subtree_control", enable)
            parents.append(parent)
        found: dict[str, Any] = {
            "cgroup": version, "cgroup_parents": tuple(sorted(set(parents))),
            "cgroup_controllers": tuple(dirs), "cgroup_error": "",
        }  # fmt: skip
        _try_group(found)
        return found
    except OSError as e:
        return {**none, "cgroup_error": f"{version}: {e}"}


def _try_group(found: dict[str, Any]) -> None:
    from .paths import Limits
    from .protections import Protections

    plan = Protections(**{k: v for k, v in found.items() if k != "cgroup_error"})
    name = call_name(os.getpid(), 0)
    dirs = create(plan, name, Limits(memory_mb=64, processes=8))
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - a child
            code = 1
            try:
                join(dirs)
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise OSError(errno.EPERM, "a process could not join its group")
    finally:
        remove(plan, name)
