"""The zygote: a clean process that forks each call's keeper ahead of need (a warm pool of
*spares*). Standard library only.

The tool server reads every call's request (the prompt fields the task declares, the state,
the arguments) and every answer. A process forked from it would carry them all, and code the
tool launches could read them (``/proc/1/mem`` of the call's pid namespace, under the call's
own uid). So, before it reads its first request, the server forks a *zygote* that never
receives one: it only forks spares when the server asks (``spare``), and reaps them when the
server is done with them (``end``). A spare is a call's keeper with its call set up (its
namespaces and mounts, its tool process forked and limited, waiting for a request): the zygote
hands the server the spare's pipes and output file (``SCM_RIGHTS``), and the server writes one
request into it. So a call's processes hold its own request and nothing of other calls, and
the set-up of a call (two forks, namespaces, mounts) is off the path between its request and its
answer. The server does not wait for a call's processes to exit either: once the answer is
read, the zygote kills what is left and reaps it.

After each call the server orders ``SPARES`` spares of its kind (with or without the network)
ahead, so their set-up runs between calls (while the model generates the next turn), not beside
a call; the zygote serves the orders one after the other. If the zygote dies, the server cannot
make a clean one again (it has seen requests): ``Zygote.broken`` says so and the server ends, to be
replaced by a fresh one (a restart, as for any lost tool server).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import select
import signal
import socket
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .linux import PR_SET_PDEATHSIG, _killpg, _oserror, _prctl, _write_all
from .server import _remove

SPARES = 1  # spares ordered ahead, per kind (with or without the network)
ORDER_TIMEOUT_S = 30.0  # the zygote must hand over a spare by then (a fork and a few pipes)
_MESSAGE_BYTES = 1 << 16


@dataclass
class Spare:
    """A keeper forked by the zygote, setting up (or set up for) one call: ``pid`` (its
    process group too), its working directory, and the server's ends of its pipes: ``request``
    (write the call's request, length-prefixed), ``answer`` (the tool's answer frame),
    ``control`` (the keeper's JSON lines), and ``output`` (the call's stdout and stderr, a
    file)."""

    pid: int
    workdir: str
    request: int
    answer: int
    control: int
    output: int
    reporter: int = -1  # (in the zygote) where it says how the spare ended; -1: its keeper does

    def fds(self) -> list[int]:
        return [self.request, self.answer, self.control, self.output]

    def close(self) -> None:
        """Close the server's ends (``reporter`` stays: the zygote's)."""
        for fd in self.fds():
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


Spawn = Callable[[bool, list[int]], Spare]  # (network, fds the keeper must close) -> a spare
# (keeper, seconds it may wait) -> its call's leftovers are gone (its cgroup): after the reap
Reaped = Callable[[int, float], bool]
LEFTOVER_RETRY_S = 0.05  # a call's leftovers not gone at once: tried again between orders
REAPED_WAIT_S = 2.0  # as the zygote ends, how long it waits for its calls' leftovers to go


class Zygote:
    """The server's side of its zygote. ``spawn`` runs in the zygote: it forks a keeper for a
    call with or without the network and returns it (its ends of the pipes closed there)."""

    def __init__(self, spawn: Spawn, reaped: Reaped | None = None) -> None:
        self._spawn = spawn
        self._reaped = reaped  # (in the zygote) after a keeper is reaped: e.g. its cgroup removed
        self.pid = -1
        self._sock: socket.socket | None = None
        self._ready: dict[bool, deque[Spare | str]] = {False: deque(), True: deque()}
        self._ordered: deque[bool] = deque()  # kinds ordered, in order, not yet handed over
        self.broken = ""  # why the zygote is gone ("" while it serves)

    def start(self) -> None:
        """Fork the zygote: call it before the first request is read."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server = os.getpid()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the zygote never returns
            ours.close()
            _serve(theirs, self._spawn, server, self._reaped)
        theirs.close()
        self.pid, self._sock = pid, ours

    def take(self, network: bool, modules: Iterable[str] = ()) -> Spare | str:
        """A spare for a call (with the network or not), or why there is none. ``modules``:
        what the zygote imports before it forks (once each)."""
        ready = self._ready[network]
        while not ready:
            if network not in self._ordered:
                self._order(network, list(modules))
            if not self._receive():
                return self.broken
        return ready.popleft()

    def prepare(self, network: bool, modules: Iterable[str] = ()) -> None:
        """Order spares of a kind up to ``SPARES``: after a call, so that the next one's set-up
        runs between calls (a turn's generation), not beside a call."""
        while self._ordered.count(network) + len(self._ready[network]) < SPARES:
            if not self._order(network, list(modules)):
                return

    def end(self, spare: Spare) -> None:
        """The call is over: the zygote kills what stayed in the spare's process group and
        reaps its keeper (the zygote is its parent: no pid is reused before that)."""
        self._send({"op": "end", "pid": spare.pid})

    def close(self) -> None:
        """End the zygote and every spare it holds; their working directories go with them."""
        for kind in self._ready.values():
            for spare in kind:
                if isinstance(spare, Spare):
                    spare.close()
                    _remove(spare.workdir)
            kind.clear()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.pid > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            self.pid = -1

    # -- the server's side of the protocol ----------------------------------------------------

    def _order(self, network: bool, modules: list[str]) -> bool:
        if not self._send({"op": "spare", "network": network, "modules": modules}):
            return False
        self._ordered.append(network)
        return True

    def _send(self, message: dict[str, Any]) -> bool:
        if self._sock is None or self.broken:
            return False
        try:
            self._sock.send(json.dumps(message).encode())
        except OSError as e:
            self.broken = f"the sandbox's zygote is gone ({_oserror(e)})"
            return False
        return True

    def _receive(self) -> bool:
        """The next spare the zygote hands over, filed under its kind; False: it is gone."""
        if self._sock is None or not self._ordered:
            self.broken = self.broken or "the sandbox's zygote is gone"
            return False
        ready, _, _ = select.select([self._sock], [], [], ORDER_TIMEOUT_S)
        data: bytes = b""
        fds: list[int] = []
        if ready:
            with contextlib.suppress(OSError):
                data, fds, _, _ = socket.recv_fds(self._sock, _MESSAGE_BYTES, 4)
        if not data:
            for fd in fds:
                os.close(fd)
            why = "gone" if ready else f"silent for {ORDER_TIMEOUT_S:g} s"
            self.broken = f"the sandbox's zygote is {why}"
            return False
        kind = self._ordered.popleft()
        msg = json.loads(data)
        if "error" in msg or len(fds) != 4:
            for fd in fds:
                os.close(fd)
            self._ready[kind].append(str(msg.get("error", "the zygote sent no pipes")))
        else:
            self._ready[kind].append(Spare(int(msg["pid"]), str(msg["workdir"]), *fds))
        return True


# -- the zygote ---------------------------------------------------------------------------------


def _serve(
    sock: socket.socket, spawn: Spawn, server: int, reaped: Reaped | None = None
) -> None:  # pragma: no cover - child
    """The zygote's loop: spares forked on order, keepers reaped when their call is over. It
    holds no file of the server's but its socket, and never reads a request. What a reaped
    call leaves that cannot go at once (a cgroup whose last processes are still exiting) is
    tried again between orders, so that the next spare is not held up by it."""
    children: set[int] = set()  # forked and not reaped: their pids are still theirs
    reporters: dict[int, int] = {}  # child -> where to report how it ended (no keeper does)
    # a call's leftovers (its cgroup) go once it is reaped and the server is done with it (it
    # reads the group's OOM count first): whichever of the two comes second adds it here
    half: set[int] = set()  # reaped or ended, not both
    leftovers: list[int] = []  # both, whose leftovers are not gone yet

    def over(pid: int) -> None:  # one of the two
        if pid in half:
            half.discard(pid)
            leftovers.append(pid)
        else:
            half.add(pid)

    def clean(wait_s: float) -> None:
        if reaped is not None:
            leftovers[:] = [k for k in leftovers if not _quiet(reaped, k, wait_s)]

    def reap_ended() -> None:
        while children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.discard(pid)
            fd = reporters.pop(pid, -1)
            if fd >= 0:
                report = {"status": status, "cpu": usage.ru_utime + usage.ru_stime}
                with contextlib.suppress(OSError):
                    _write_all(fd, json.dumps(report).encode() + b"\n")
                os.close(fd)
            over(pid)

    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != server:
            return
        keep = {0, 1, 2, sock.fileno()}
        for entry in Path("/proc/self/fd").iterdir():  # the server's pipe to the node among them
            if int(entry.name) not in keep:
                with contextlib.suppress(OSError):
                    os.close(int(entry.name))
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)  # a child ended: reaped (and reported) at once
        signal.signal(signal.SIGCHLD, lambda *_: None)
        imported: set[str] = set()
        gc.freeze()  # what is here stays untouched by the children's collections (fewer copies)
        while True:
            wait = LEFTOVER_RETRY_S if leftovers else None
            ready = select.select([sock.fileno(), wake_r], [], [], wait)[0]
            if wake_r in ready:
                with contextlib.suppress(OSError):
                    os.read(wake_r, 4096)
                reap_ended()
                clean(0.0)
            if sock.fileno() not in ready:
                if not ready:
                    clean(0.0)
                continue
            try:
                data = sock.recv(_MESSAGE_BYTES)
            except OSError:
                return
            if not data:
                return  # the server is gone
            msg = json.loads(data)
            if msg.get("op") == "end":
                pid = int(msg["pid"])
                if pid in children:  # not reaped: the pid (and its group) still the call's
                    _killpg(pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                over(pid)
                clean(0.0)
                continue
            new = [m for m in msg.get("modules", ()) if m not in imported]
            for module in new:  # once here, not in every call's processes
                imported.add(module)
                with contextlib.suppress(Exception):  # the call's tool process says why, if any
                    importlib.import_module(module)
            if new:
                gc.freeze()
            try:
                spare = spawn(bool(msg.get("network")), [sock.fileno(), wake_r, wake_w])
            except OSError as e:  # no process or file for it (EAGAIN, ENOSPC): the call's failure
                sock.send(json.dumps({"error": _oserror(e)}).encode())
                continue
            children.add(spare.pid)
            if spare.reporter >= 0:
                reporters[spare.pid] = spare.reporter
            try:
                reply = json.dumps({"pid": spare.pid, "workdir": spare.workdir}).encode()
                socket.send_fds(sock, [reply], [spare.request, spare.answer, spare.control,
                                                spare.output])  # fmt: skip
            finally:
                spare.close()  # the server holds them now
    except BaseException:  # the server sees the socket close
        pass
    finally:
        for pid in list(children):
            _reap(pid)
        leftovers.extend(children | half)
        clean(REAPED_WAIT_S)
        os._exit(0)


def _reap(pid: int) -> None:  # pragma: no cover - runs in the zygote
    _killpg(pid)  # what stayed in the call's group (before the reap: the pid is still its)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _quiet(reaped: Reaped, keeper: int, wait_s: float) -> bool:  # pragma: no cover - zygote
    try:
        return reaped(keeper, wait_s)
    except Exception:  # given up on: a sweep of a later server removes it
        return True
