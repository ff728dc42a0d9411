"""A call (``Sandbox.run``): the keeper that sets it up, the tool process that runs it, and the
server's side that waits for its answer. Standard library only."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import resource
import select
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import cgroups, seccomp
from .linux import (
    CLONE_NEWPID,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    PR_SET_DUMPABLE,
    PR_SET_NO_NEW_PRIVS,
    PR_SET_PDEATHSIG,
    _drop_bounding_set,
    _drop_capabilities,
    _mount,
    _oserror,
    _prctl,
    _processes_of,
    _setns,
    _signame,
    _unshare,
    _write_all,
)
from .namespaces import TOOL_UID_BASE, _enter
from .paths import Layout, Limits
from .protections import Protections
from .server import WORKDIR_PREFIX, _forward_output, _remove
from .zygote import Spare, Zygote

START_TIMEOUT_S = 45.0  # the keeper must have set the call up by then (below the node's)
KILL_WAIT_S = 5.0  # after a kill, how long the keeper's report is awaited


_EXIT_FAILED = 70  # the tool process's own code failed outside the tool (a bug of ours)


# -- a call ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallResult:
    """How a call ended: ``answer`` (what the tool process sent), or ``failure`` (``timeout``,
    ``cpu``, ``file``, ``crashed``, ``setup``) and ``detail``."""

    answer: bytes | None = None
    failure: str | None = None
    detail: str = ""
    cpu_s: float = 0.0


class Sandbox:
    """Runs calls as the module docstring says; used by the tool server, a single-threaded
    process (it forks). ``handler`` runs in a call's tool process: a request's bytes to its
    answer's. ``start`` forks the zygote (``zygote``): before the server reads any request."""

    def __init__(
        self,
        limits: Limits,
        plan: Protections,
        lay: Layout,
        handler: Callable[[bytes], bytes],
        answer_bytes: int = 16 << 20,
    ) -> None:
        self.limits = limits
        self.plan = plan
        self.layout = lay
        self.handler = handler
        self.answer_bytes = answer_bytes  # a longer answer frame: the call crashed
        self.server = os.getpid()
        self._zygote: Zygote | None = None
        # As root with pid and mount namespaces, a call is one process: the zygote forks it as
        # the first process of a pid namespace of its own (``unshare(CLONE_NEWPID)`` before the
        # fork, its own pid namespace taken back after), so no keeper is forked, and the zygote
        # reports how it ended. Otherwise (a user namespace is made in the child) a keeper.
        self.direct = plan.mode == "root" and plan.pids and plan.mounts
        self._pidns = -1  # (the zygote's) its own pid namespace, to go back to after a fork

    def start(self) -> None:
        if self._zygote is None:
            if self.plan.seccomp:
                seccomp.prepare()  # (the zygote's children inherit it built)
            self.server = os.getpid()
            self._zygote = Zygote(self._spawn, self._reaped)
            self._zygote.start()

    @property
    def broken(self) -> str:
        """Why no call can run any more (the zygote is gone), or ""."""
        return self._zygote.broken if self._zygote is not None else ""

    def prepare(self, network: bool, modules: tuple[str, ...] = ()) -> None:
        """Have a spare set up for the next call of this kind (``Zygote.prepare``)."""
        if self._zygote is not None:
            self._zygote.prepare(network, modules)

    def close(self) -> None:
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None

    def run(
        self,
        request: bytes,
        *,
        network: bool,
        timeout_s: float,
        started: Callable[[], None],
        modules: tuple[str, ...] = (),
    ) -> CallResult:
        """``handler(request)`` in a fresh tool process (a spare); its bytes, or why there are
        none. ``started`` is called once the call is set up (or failed to be): ``timeout_s``
        counts from there. ``modules``: what the zygote imports for the calls to come."""
        self.start()
        assert self._zygote is not None
        spare = self._zygote.take(network, modules)
        if isinstance(spare, str):
            started()
            return CallResult(failure="setup", detail=spare)
        try:
            return self._watch(spare, request, timeout_s, started)
        finally:
            output = os.fdopen(spare.output, "rb")
            spare.output = -1
            spare.close()
            self._zygote.end(spare)  # what stayed in the call's group killed, its keeper reaped
            _forward_output(output)
            _remove(spare.workdir)

    # -- in the zygote: a spare -----------------------------------------------------------------

    def _spawn(self, network: bool, close: list[int]) -> Spare:  # pragma: no cover - zygote
        """Fork a keeper that sets a call up and waits for its request (in the zygote)."""
        prefix = f"{WORKDIR_PREFIX}{self.server}-"  # the server's pid: ``sweep`` after it
        workdir = tempfile.mkdtemp(prefix=prefix, dir=self.layout.workdirs)
        fds: list[int] = []
        try:
            with tempfile.TemporaryFile(dir=self.layout.workdirs) as output:
                fds.append(os.dup(output.fileno()))
            for _ in range(3):
                fds.extend(os.pipe())
            out, req_r, req_w, ans_r, ans_w, ctl_r, ctl_w = fds
            zygote = os.getpid()
            if self.direct and self._pidns < 0:
                self._pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
                try:  # (a no-op) it may go back: not root of a user namespace of a container's
                    _setns(self._pidns, CLONE_NEWPID)
                except OSError:
                    self.direct = False
            if self.direct:
                _unshare(CLONE_NEWPID)  # its next child: the first of a pid namespace
            try:
                keeper = os.fork()
            finally:
                if self.direct and os.getpid() == zygote:
                    _setns(self._pidns, CLONE_NEWPID)  # the zygote's own children's again
            if keeper == 0:
                for fd in (*close, req_w, ans_r, ctl_r):
                    os.close(fd)
                if self.direct:
                    self._direct(network, workdir, out, req_r, ans_w, ctl_w)
                self._keeper(network, workdir, out, req_r, ans_w, ctl_w, zygote)
            for fd in (req_r, ans_w):
                os.close(fd)
            if not self.direct:  # (direct: the zygote reports how the call ended)
                os.close(ctl_w)
                ctl_w = -1
            return Spare(keeper, workdir, req_w, ans_r, ctl_r, out, reporter=ctl_w)
        except BaseException:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            _remove(workdir)
            raise

    def _reaped(self, keeper: int, wait_s: float) -> bool:  # pragma: no cover - in the zygote
        """A call's keeper is reaped: its cgroup goes (what is left killed, then rmdir, tried
        for ``wait_s``); whether it is gone."""
        if self.plan.cgroup == "none":
            return True
        return cgroups.remove(self.plan, cgroups.call_name(self.server, keeper), wait_s)

    # -- the keeper (a child) and the tool process (its child) --------------------------------

    def _direct(
        self, network: bool, workdir: str, out_fd: int, req_r: int, ans_w: int, ctl_w: int
    ) -> None:  # pragma: no cover - runs in a child
        """As root: the call's one process, the first of its pid namespace (``self.direct``):
        the keeper's set-up, then the tool process's."""
        try:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            signal.set_wakeup_fd(-1)  # (the zygote's)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
            host = int(Path("/proc/self").readlink().name)  # its pid outside (the node's /proc)
            plan = dataclasses.replace(self.plan, flags=self.plan.flags & ~CLONE_NEWPID)
            _enter(
                plan, self.layout, network=network, workdir=workdir,
                size_mb=max(self.limits.file_mb, 1),
            )  # fmt: skip
            uid = None
            if self.plan.drop_uid:
                uid = TOOL_UID_BASE + host
                os.chown(workdir, uid, uid)
            group = []
            if self.plan.cgroup != "none":
                group = cgroups.create(self.plan, cgroups.call_name(self.server, host), self.limits)
        except BaseException as e:
            why = _oserror(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
            with contextlib.suppress(OSError):
                _write_all(ctl_w, json.dumps({"error": why}).encode() + b"\n")
            os._exit(1)
        self._tool(uid, self.limits.processes, workdir, out_fd, req_r, ans_w, True, -1, group,
                   ctl_w, host)  # fmt: skip

    def _keeper(
        self,
        network: bool,
        workdir: str,
        out_fd: int,
        req_r: int,
        ans_w: int,
        ctl_w: int,
        zygote: int,
    ) -> None:  # pragma: no cover - runs in a child
        code = 1
        try:
            signal.set_wakeup_fd(-1)  # (the zygote's)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
            _enter(
                self.plan, self.layout, network=network, workdir=workdir,
                size_mb=max(self.limits.file_mb, 1),
            )  # fmt: skip
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the set-up: a uid change clears it
            if os.getppid() != zygote:
                return
            uid = None  # the uid the tool process takes (root: one of the call's own)
            if self.plan.drop_uid and self.plan.mode != "userns":  # (userns: the keeper took it)
                uid = TOOL_UID_BASE + os.getpid()
                os.chown(workdir, uid, uid)
            nproc = self.limits.processes
            if self.plan.processes == "approximate":
                nproc += _processes_of(os.getuid())
            mount_proc = self.plan.mode != "none" and self.plan.mounts and self.plan.pids
            group = []  # the call's cgroup (its directories): the tool process joins it
            if self.plan.cgroup != "none":
                group = cgroups.create(
                    self.plan, cgroups.call_name(self.server, os.getpid()), self.limits
                )
            alive_r, alive_w = os.pipe()  # closed when the keeper dies: the tool then ends
            tool = os.fork()
            if tool == 0:
                os.close(alive_w)
                os.close(ctl_w)
                self._tool(uid, nproc, workdir, out_fd, req_r, ans_w, mount_proc, alive_r, group)
            os.close(alive_r)
            os.close(ans_w)
            os.close(req_r)
            _write_all(ctl_w, json.dumps({"pid": tool}).encode() + b"\n")
            _, status, usage = os.wait4(tool, 0)
            cpu = usage.ru_utime + usage.ru_stime
            _write_all(ctl_w, json.dumps({"status": status, "cpu": cpu}).encode() + b"\n")
            code = 0
        except BaseException as e:
            why = _oserror(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
            with contextlib.suppress(OSError):
                _write_all(ctl_w, json.dumps({"error": why}).encode() + b"\n")
        finally:
            os._exit(code)

    def _tool(
        self,
        uid: int | None,
        nproc: int,
        workdir: str,
        out_fd: int,
        req_r: int,
        ans_w: int,
        mount_proc: bool,
        alive_r: int,
        group: list[str],
        ctl_w: int = -1,
        host: int = 0,
    ) -> None:  # pragma: no cover - runs in a child
        """The tool process: its limits, then its request, its tool and its answer. ``alive_r``
        (-1: none) tells it its keeper died; ``ctl_w`` (direct: no keeper) gets its ``host``
        pid once it is set up."""
        code = _EXIT_FAILED
        try:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            cgroups.join(group)  # first: what it allocates and starts counts there
            if mount_proc:  # this pid namespace's processes only; else the call fails
                _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            # out of the way first (any of them may be 0 to 4)
            alive_r = alive_r if alive_r >= 0 else os.open(os.devnull, os.O_RDONLY)
            ctl_w = ctl_w if ctl_w >= 0 else os.open(os.devnull, os.O_WRONLY)
            out_fd, ans_w, alive_r, req_r, ctl_w = (
                fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 64)
                for fd in (out_fd, ans_w, alive_r, req_r, ctl_w)
            )
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(out_fd, 1)
            os.dup2(out_fd, 2)
            os.dup2(ans_w, 3, inheritable=False)  # not the tool's subprocesses'
            os.dup2(alive_r, 4, inheritable=False)
            os.dup2(req_r, 5, inheritable=False)
            os.dup2(ctl_w, 6, inheritable=False)
            os.closerange(7, 1 << 20)
            lim = self.limits
            for which, value in (
                (resource.RLIMIT_CORE, 0),
                (resource.RLIMIT_CPU, lim.cpu_s),
                (resource.RLIMIT_AS, lim.memory_mb * 1024 * 1024),
                (resource.RLIMIT_NPROC, nproc),
                (resource.RLIMIT_NOFILE, lim.open_files),
                (resource.RLIMIT_FSIZE, lim.file_mb * 1024 * 1024),
            ):
                if value > 0 or which == resource.RLIMIT_CORE:
                    hard = resource.getrlimit(which)[1]
                    if hard != resource.RLIM_INFINITY:
                        value = min(value, hard)
                    resource.setrlimit(which, (value, value))
            _drop_bounding_set()  # (while it may: before a uid change)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                # a uid change makes it undumpable: its /proc/self would be root's, unreadable
                # to it (its uid is the call's alone, so no other process may trace it)
                _prctl(PR_SET_DUMPABLE, 1)
                _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the uid change cleared it
            # no capability left (in a user namespace it had them all: it could unmount what
            # covers the node's files), none to gain (setuid files)
            _drop_capabilities()
            _prctl(PR_SET_NO_NEW_PRIVS, 1)
            if self.plan.seccomp:  # (after no_new_privs: unprivileged, it needs it)
                seccomp.install()
            if not host and select.select([4], [], [], 0)[0]:  # the keeper died before
                return  # PDEATHSIG was set
            os.close(4)
            if host:  # set up: the server may send the request
                _write_all(6, json.dumps({"pid": host}).encode() + b"\n")
            os.close(6)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            os.chdir(workdir)
            path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
            lang = os.environ.get("LANG", "C.UTF-8")
            os.environ.clear()
            os.environ.update(PATH=path, LANG=lang, HOME=workdir, TMPDIR=workdir)
            tempfile.tempdir = workdir
            request = _read_frame(5)  # a spare waits here until its call comes
            os.close(5)
            if request is None:  # never used (the server ended)
                code = 0
                return
            data = self.handler(request)
            _write_all(3, len(data).to_bytes(8, "big") + data)
            code = 0
        except BaseException as e:  # said in the call's output (the node's log gets it)
            with contextlib.suppress(BaseException):
                _write_all(2, f"rollcall: the tool process failed: {_oserror(e)}\n".encode())
        finally:
            os._exit(code)

    # -- the server's side ---------------------------------------------------------------------

    def _watch(
        self, spare: Spare, request: bytes, timeout_s: float, started: Callable[[], None]
    ) -> CallResult:
        ans_r, ctl_r = spare.answer, spare.control
        ctl = _Lines(ctl_r)
        first = ctl.next(time.monotonic() + START_TIMEOUT_S)
        started()
        if first is None or "pid" not in first:
            why = (first or {}).get("error", "the call's keeper died while setting it up")
            return CallResult(failure="setup", detail=str(why))
        tool = int(first["pid"])
        frame = len(request).to_bytes(8, "big") + request
        if not _write_frame(spare.request, frame, time.monotonic() + START_TIMEOUT_S):
            with contextlib.suppress(ProcessLookupError):
                os.kill(tool, signal.SIGKILL)  # (still this call's: its keeper has not reaped it)
        os.close(spare.request)
        spare.request = -1
        answer = _Frame(self.answer_bytes)
        report: dict[str, Any] | None = None
        deadline = time.monotonic() + timeout_s
        os.set_blocking(ans_r, False)
        ans_open = True
        while answer.data is None and report is None and not answer.over:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            fds = [ctl_r, ans_r] if ans_open else [ctl_r]
            ready, _, _ = select.select(fds, [], [], left)
            if ans_r in ready:
                ans_open = answer.feed(ans_r)
            if ctl_r in ready:
                report = ctl.next(time.monotonic() + KILL_WAIT_S) or {"lost": True}
        if report is not None and answer.data is None:  # ended: what it wrote is in the pipe
            answer.feed(ans_r)
        if answer.over:  # never read: the call crashed
            with contextlib.suppress(ProcessLookupError):
                os.kill(tool, signal.SIGKILL)
            report = report or ctl.next(time.monotonic() + KILL_WAIT_S) or {}
            why = (
                f"the tool's answer is over its limit ({answer.over:,} bytes, at most "
                f"{self.answer_bytes:,})"
            )
            return CallResult(failure="crashed", detail=why, cpu_s=float(report.get("cpu", 0.0)))
        if answer.data is not None:  # not waited for its exit: the zygote's ``end`` kills it
            return CallResult(answer=answer.data, cpu_s=float((report or {}).get("cpu", 0.0)))
        timed_out = report is None
        if report is None:  # still running (timed out)
            if timed_out:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(tool, signal.SIGKILL)  # not reaped yet: still this call's pid
            report = ctl.next(time.monotonic() + KILL_WAIT_S)
            if report is None:  # the keeper is gone
                with contextlib.suppress(ProcessLookupError):
                    os.kill(tool, signal.SIGKILL)
                report = ctl.next(time.monotonic() + KILL_WAIT_S) or {"lost": True}
        cpu = float(report.get("cpu", 0.0))
        if timed_out:
            return CallResult(failure="timeout", cpu_s=cpu)
        return self._death(report, cpu, spare.pid)

    def _death(self, report: dict[str, Any], cpu: float, keeper: int) -> CallResult:
        if "status" not in report:
            return CallResult(failure="crashed", detail="its process was lost", cpu_s=cpu)
        status = int(report["status"])
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            group = cgroups.call_name(self.server, keeper)
            if sig == signal.SIGKILL and cgroups.oom_killed(self.plan, group):
                return CallResult(failure="memory", detail=self.limits.memory_message(), cpu_s=cpu)
            # RLIMIT_CPU (soft = hard: SIGKILL). A SIGKILL the server did not send: in a pid
            # namespace the tool process is its init, which no process of the namespace can
            # kill (itself included), so it is the kernel's: the CPU limit (the OOM killer
            # aside). Without one, the CPU time says it; the time a wait reports is tick-based
            # and was seen 20% short of the limit on a busy machine.
            spent = self.plan.pids or cpu >= 0.5 * self.limits.cpu_s
            if sig == signal.SIGXCPU or (sig == signal.SIGKILL and spent):
                return CallResult(failure="cpu", detail=self.limits.cpu_message(), cpu_s=cpu)
            if sig == signal.SIGXFSZ:
                return CallResult(failure="file", detail=self.limits.file_message(), cpu_s=cpu)
            why = f"killed by {_signame(sig)} after {cpu:.2f} s of CPU"
            return CallResult(failure="crashed", detail=why, cpu_s=cpu)
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else status
        return CallResult(failure="crashed", detail=f"exit status {code}", cpu_s=cpu)


class _Frame:
    """A length-prefixed answer read from a non-blocking pipe."""

    def __init__(self, limit: int) -> None:
        self.buf = bytearray()
        self.data: bytes | None = None
        self.limit = limit
        self.over = 0  # the length a frame over ``limit`` said it has (then nothing more read)

    def feed(self, fd: int) -> bool:
        """Read what is there; False once the pipe is closed, or the frame is over its limit."""
        while not self.over:
            try:
                chunk = os.read(fd, 1 << 20)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not chunk:
                return False
            self.buf += chunk
            if len(self.buf) >= 8:
                need = int.from_bytes(self.buf[:8], "big")
                if need > self.limit:
                    self.over = need
                    self.buf = bytearray()
                elif len(self.buf) >= 8 + need:
                    self.data = bytes(self.buf[8 : 8 + need])
                    return True
        return False


class _Lines:
    """JSON lines from the keeper's pipe."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""
        self.closed = False

    def next(self, deadline: float) -> dict[str, Any] | None:
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if self.closed or left <= 0:
                return None
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(self.fd, 65536)
            if not chunk:
                self.closed = True
                continue
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        try:
            value: dict[str, Any] = json.loads(line)
        except ValueError:
            return None
        return value


def _write_frame(fd: int, data: bytes, deadline: float) -> bool:
    """Write ``data`` into a pipe by ``deadline``; False if the reader is gone or too slow
    (then the call's report says what became of it)."""
    os.set_blocking(fd, False)
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [fd], [], left)[1]:
                return False
        except OSError:  # EPIPE: the tool process is gone
            return False
    return True


def _read_frame(fd: int) -> bytes | None:  # pragma: no cover - runs in the tool process
    """A length-prefixed request from a pipe; None at its end before a whole one."""
    buf = bytearray()
    need = 8
    while len(buf) < need:
        chunk = os.read(fd, max(need - len(buf), 1 << 16))
        if not chunk:
            return None
        buf += chunk
        if need == 8 and len(buf) >= 8:
            need = 8 + int.from_bytes(buf[:8], "big")
    return bytes(buf[8:need])
