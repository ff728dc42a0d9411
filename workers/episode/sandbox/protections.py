"""What the sandbox can do on this machine (``Protections``), found by trying each set-up step
in a bare interpreter (``probe``: ``probe_main.py`` run by file path). Standard library only."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from . import cgroups, seccomp
from .linux import (
    _FLAG_NAMES,
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    _mount,
    _oserror,
    _write_all,
)
from .namespaces import TOOL_UID_BASE, _enter
from .paths import Layout, Limits, _reachable, layout


@dataclass(frozen=True)
class Protections:
    """What a call's set-up does on this machine (``probe``): ``mode`` "root" (namespaces made
    as root), "userns" (in a user namespace of the call's) or "none"; ``flags`` the namespaces
    of a call without the network; ``drop_uid``: as root, the tool runs as a uid of its own."""

    root: bool = False
    mode: str = "none"
    flags: int = 0
    drop_uid: bool = False
    hidden: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()  # what is missing and why, one sentence each
    network_error: str = ""  # why there is no network namespace ("" if there is one)
    scratch: tuple[str, ...] = ()  # a fresh tmpfs of the call's own on each
    seccomp: bool = False  # the tool process gets ``seccomp``'s filter
    seccomp_error: str = ""  # why not ("" if it does)
    cgroup: str = "none"  # a cgroup per call: "v1", "v2" or "none" (``cgroups``)
    cgroup_parents: tuple[str, ...] = ()  # where the calls' groups are made, per hierarchy
    cgroup_controllers: tuple[str, ...] = ()  # memory, pids, and io (v2) or blkio (v1)
    cgroup_error: str = ""  # why there is none ("" if there is)

    @property
    def network(self) -> bool:
        return bool(self.flags & CLONE_NEWNET)

    @property
    def pids(self) -> bool:
        return bool(self.flags & CLONE_NEWPID)

    @property
    def mounts(self) -> bool:
        return bool(self.flags & CLONE_NEWNS)

    @property
    def ipc(self) -> bool:
        return bool(self.flags & CLONE_NEWIPC)

    @property
    def processes(self) -> str:
        """How RLIMIT_NPROC holds: "per call", "approximate" or "not" (root's processes)."""
        if self.root:
            return "per call" if self.drop_uid else "not"
        return "per call" if self.mode == "userns" else "approximate"

    def describe(self, limits: Limits, network_tasks: Iterable[str] = ()) -> str:
        """One line for the terminal: what a tool call gets, first what it does not."""
        if limits.level == "process":
            return (
                "tool sandbox: level process: tools run in one process per agent loop with the "
                f"node's network, files, user and environment; only their address space is "
                f"limited ({limits.memory_mb} MiB)"
            )
        granted = sorted(network_tasks)
        parts = []
        if self.network:
            parts.append(
                "no network (a network namespace of the call's own)"
                + (f"; the network for {', '.join(granted)}" if granted else "")
            )
        else:
            parts.append(
                f"no network namespace ({self.network_error}); tools can reach the network"
            )
        parts.append(
            "a pid namespace of the call's own"
            if self.pids
            else "no pid namespace (a process a tool starts in a new session outlives the call)"
        )
        parts.append(
            "an IPC namespace of the call's own (its SysV shared memory, semaphores and message "
            "queues, and POSIX message queues, die with it)"
            if self.ipc
            else "no IPC namespace (SysV shared memory a tool makes outlives the call and other "
            "calls may read it)"
        )
        if self.mounts:
            parts.append(f"hidden: {', '.join(self.hidden) or 'nothing'}")
            if self.scratch:
                parts.append(
                    f"fresh and private: {', '.join(self.scratch)} ({limits.file_mb} MiB each)"
                )
        else:
            parts.append(
                "no mount namespace: tools read what their user may read, the node's "
                "sockets and temporary files among it"
            )
        if not (self.pids and self.mounts):
            parts.append(
                "no pid and mount namespaces of the call's own: tools see the node's "
                "processes in /proc (their command lines, and what their user may read of them)"
            )
        parts.append(
            "a seccomp filter (no new namespaces, io_uring, bpf, ptrace, keyring, mounts, "
            "kernel modules, vsock, clock changes and the like: EPERM)"
            if self.seccomp
            else f"no seccomp filter ({self.seccomp_error})"
        )
        if self.cgroup != "none":
            io = {"io": ", I/O weight", "blkio": ", I/O weight where the scheduler has one"}
            extra = "".join(io.get(c, "") for c in self.cgroup_controllers)
            parts.append(
                f"a cgroup of the call's own ({self.cgroup}: {limits.memory_mb} MiB of memory "
                f"across its processes, {limits.processes} processes{extra})"
            )
        else:
            parts.append(
                f"no cgroup per call ({self.cgroup_error}): memory is limited per process only"
            )
        if self.root:
            parts.append(
                f"runs as a uid of its own ({TOOL_UID_BASE} + its pid)"
                if self.drop_uid
                else "runs as root"
            )
        else:
            parts.append("runs as the node's user")
        nproc = {
            "per call": f"{limits.processes} processes",
            "approximate": f"{limits.processes} processes more than its user had",
            "not": "processes not limited (root's are not counted)",
        }[self.processes]
        parts.append(
            f"per call: {limits.cpu_s} s CPU, {limits.memory_mb} MiB memory, {nproc}, "
            f"{limits.open_files} open files, {limits.file_mb} MiB per file"
        )
        return "tool sandbox: " + "; ".join(parts)


# run by file path in a bare interpreter (``python -I -S``): it calls ``main``
SCRIPT = "probe_main.py"
_probe_lock = threading.Lock()
_probed: Protections | None = None


def probe() -> Protections:
    """What the sandbox can do here (cached per process): found by trying, in a separate
    interpreter (``SCRIPT`` run by itself: the caller may have threads, which a fork must not
    copy), each set-up step a call makes."""
    global _probed
    with _probe_lock:
        if _probed is None:
            _probed = _probe_in_subprocess(layout())
        return _probed


def _probe_in_subprocess(lay: Layout) -> Protections:
    root = os.geteuid() == 0
    script = Path(__file__).resolve().with_name(SCRIPT)
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-S", str(script), "--probe"],
            input=json.dumps(asdict(lay)), capture_output=True, text=True, timeout=60,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, cwd="/", check=True,
        )  # fmt: skip
        return _protections(json.loads(done.stdout))
    except Exception as e:  # no namespaces then: say why
        why = f"the sandbox probe failed ({type(e).__name__}: {e})"
        return Protections(root=root, problems=(why,), network_error=why)


def _protections(data: dict[str, Any]) -> Protections:
    data = dict(data)
    for k in ("hidden", "problems", "scratch", "cgroup_parents", "cgroup_controllers"):
        data[k] = tuple(data.get(k, ()))
    return Protections(**data)


def probe_here(lay: Layout) -> Protections:
    """``probe``'s work, in this process (which must be single-threaded): each mode and set of
    namespaces tried in a forked child, the first that works kept; then the seccomp filter and
    the cgroup per call."""
    found = _namespaces_here(lay)
    filter_error = seccomp.try_here()
    problems = found.problems + ((f"no seccomp filter ({filter_error})",) if filter_error else ())
    groups = cgroups.probe_here(found.root)
    if groups["cgroup_error"]:
        problems += (f"no cgroup per call ({groups['cgroup_error']})",)
    return replace(
        found, problems=problems, seccomp=not filter_error, seccomp_error=filter_error, **groups
    )


def _namespaces_here(lay: Layout) -> Protections:
    root = os.geteuid() == 0
    reachable = _reachable((*lay.needed, lay.workdirs))
    modes = ["root", "userns"] if root else ["userns"]
    subsets = [
        CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID, CLONE_NEWNET | CLONE_NEWPID,
        CLONE_NEWNET | CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWNS | CLONE_NEWPID, CLONE_NEWPID,
        CLONE_NEWNS,
    ]  # fmt: skip
    # each with an IPC namespace first (a kernel without CONFIG_IPC_NS: without)
    subsets = [f for s in subsets for f in (s | CLONE_NEWIPC, s)]
    first_error = ""
    net_error = ""
    for mode in modes:
        for flags in subsets:
            # root in a user namespace: as a uid of its own only if it can reach the interpreter
            plan = Protections(root, mode, flags, drop_uid=root and (mode == "root" or reachable))
            result = _try_in_child(plan, lay)
            if "error" in result:
                first_error = first_error or result["error"]
                if flags & CLONE_NEWNET:
                    net_error = net_error or result["error"]
                continue
            drop = plan.drop_uid and bool(result["reachable"])
            problems = []
            if plan.drop_uid and result.get("uid_error"):  # e.g. root in a user namespace
                drop = False
                problems.append(f"tools run as root: no uid of their own ({result['uid_error']})")
            if not flags & CLONE_NEWNET:
                problems.append(f"no network namespace ({net_error})")
            if root and not drop:
                problems.append(
                    "tools run as root, whose processes the kernel does not count: the "
                    "interpreter is not readable by other users"
                )
            missing = [n for f, n in _FLAG_NAMES.items() if f != CLONE_NEWUSER and not f & flags]
            if missing:
                problems.append(f"without {', '.join(missing)} ({first_error})")
            scratch = lay.scratch if flags & CLONE_NEWNS else ()
            return Protections(
                root, mode, flags, drop, tuple(result["hidden"]), tuple(problems), net_error,
                scratch,
            )  # fmt: skip
    why = first_error or "no namespace could be made"
    problems = [f"no namespaces ({why})"]
    if root and not reachable:
        problems.append("tools run as root: the interpreter is not readable by other users")
    return Protections(root, "none", 0, root and reachable, (), tuple(problems), why)


def _try_in_child(plan: Protections, lay: Layout) -> dict[str, Any]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - a child
        code = 1
        try:
            os.close(r)
            os.setsid()
            hidden = _enter(plan, lay, network=False, workdir=None, size_mb=1)
            # the tool process's own view: can a uid of its own reach the interpreter here?
            reachable = _reachable((*lay.needed, lay.workdirs))
            proc_error, uid_error = _try_tool_steps(plan)
            if proc_error:  # the call would fail: a plan without it instead
                raise OSError(errno.EPERM, proc_error)
            said = {"hidden": hidden, "reachable": reachable, "uid_error": uid_error}
            _write_all(w, json.dumps(said).encode())
            code = 0
        except OSError as e:
            _write_all(w, json.dumps({"error": _oserror(e)}).encode())
        except BaseException as e:
            _write_all(w, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    try:
        result: dict[str, Any] = json.loads(data)
    except ValueError:
        result = {"error": "the probe's child died"}
    return result


def _try_tool_steps(plan: Protections) -> tuple[str, str]:
    """In the probe's child, after ``_enter``: what the tool process does, in a grandchild
    (the first process of the pid namespace): mount /proc (a pid and a mount namespace), take
    a uid of its own (root, ``drop_uid``). Why each failed ("" if it did not)."""
    uid_switch = plan.drop_uid and plan.mode == "root"
    both = CLONE_NEWNS | CLONE_NEWPID
    mount_proc = plan.mode != "none" and plan.flags & both == both
    if not (uid_switch or mount_proc):
        return "", ""
    keeper = os.getpid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - a child
        out = {"proc": "", "uid": ""}
        try:
            os.close(r)
            if mount_proc:
                try:
                    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                except OSError as e:
                    out["proc"] = _oserror(e)
            if uid_switch:
                try:
                    uid = TOOL_UID_BASE + keeper
                    os.setgroups([])
                    os.setgid(uid)
                    os.setuid(uid)
                except OSError as e:
                    out["uid"] = _oserror(e)
            _write_all(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    try:
        got = json.loads(data)
    except ValueError:
        return "the probe's grandchild died", ""
    return str(got["proc"]), str(got["uid"])


def main() -> None:  # pragma: no cover - ``probe`` runs it in a bare interpreter
    """``probe_here`` of the ``Layout`` on stdin; the ``Protections`` found, on stdout (JSON)."""
    data = json.loads(sys.stdin.read())
    lay = Layout(**{k: v if isinstance(v, str) else tuple(v) for k, v in data.items()})  # type: ignore[arg-type]
    sys.stdout.write(json.dumps(asdict(probe_here(lay))))
