"""Processes as Linux's ``/proc`` shows them: one parse of ``/proc/PID/stat`` for every place
that needs a process's state, parent or name (the engine's watchdog and orphan checks, the
drills, the embedded PostgreSQL, benchmarks and tests). Depends on nothing in the project."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Stat:
    pid: int
    name: str  # the command name (cut at 15 characters by the kernel)
    fields: tuple[str, ...]  # the fields after the name: state, ppid, ... (proc(5), from 3)

    @property
    def state(self) -> str:
        return self.fields[0]

    @property
    def ppid(self) -> int:
        return int(self.fields[1])

    @property
    def zombie(self) -> bool:
        return self.state in ("Z", "X")

    @property
    def start_ticks(self) -> int:
        """When it started, in clock ticks since boot (proc(5) field 22): with the pid, which
        process this is (a pid is reused once its process is gone)."""
        return int(self.fields[19])


def stat(pid: int) -> Stat | None:
    """The process's stat line, None when there is no such process. The name is in parens and
    may itself hold spaces and parens: the fields are what follows the last ``)``."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    head, _, rest = text.rpartition(")")
    fields = tuple(rest.split())
    if len(fields) < 2:
        return None
    return Stat(pid, head.partition("(")[2], fields)


def identity(pid: int) -> tuple[int, int] | None:
    """``(pid, start ticks)`` of a live process: what ``signal_same`` later checks, so that a
    signal meant for a process that ended meanwhile never reaches the one that got its pid."""
    s = stat(pid)
    return None if s is None or s.zombie else (pid, s.start_ticks)


def signal_same(ident: tuple[int, int] | None, signum: int) -> bool:
    """Send ``signum`` to the process ``ident`` names if it is still that process (the same
    start time): False when it is gone, or its pid now belongs to another process. (The pid
    could be reused between the check and the signal only by a process started within that
    instant after the whole pid range wrapped: not a window a fork rate reaches.)"""
    if ident is None:
        return False
    s = stat(ident[0])
    if s is None or s.zombie or s.start_ticks != ident[1]:
        return False
    try:
        os.kill(ident[0], signum)
    except ProcessLookupError:
        return False
    return True


def alive(pid: int) -> bool:
    """A process of that pid that is not a zombie."""
    s = stat(pid)
    return s is not None and not s.zombie


def parent_of(pid: int) -> int | None:
    s = stat(pid)
    return None if s is None else s.ppid


def processes() -> Iterator[Stat]:
    """Every process there is (those that end while being read are left out)."""
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (s := stat(int(entry.name))) is not None:
            yield s


def children_of(pid: int) -> list[int]:
    return sorted(s.pid for s in processes() if s.ppid == pid)


def descendants_of(pid: int) -> list[int]:
    """``pid``'s children, their children, and so on (one pass over ``/proc``)."""
    kids: dict[int, list[int]] = {}
    for s in processes():
        kids.setdefault(s.ppid, []).append(s.pid)
    out: list[int] = []
    todo = list(kids.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return sorted(out)


def cmdline(pid: int) -> str:
    """The process's command line, arguments joined by spaces ("" when gone or a kernel
    thread)."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def forked(pid: int) -> bool:
    """Whether the process is a multiprocessing forkserver or was forked from one (a forked
    child keeps its forkserver's command line): the rollout nodes' tool servers and the
    sandbox's per-call processes."""
    return is_forked(cmdline(pid))


def is_forked(line: str) -> bool:
    """``forked`` for a command line already read (``cmdline``)."""
    return "multiprocessing.forkserver" in line


def _socket_inodes(pid: int) -> set[int]:
    inodes: set[int] = set()
    try:
        fds = list((PROC / str(pid) / "fd").iterdir())
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = str(fd.readlink())
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _address(hex_addr: str) -> str:
    import ipaddress

    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    # IPv6: four 32-bit words, each in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    v6 = ipaddress.IPv6Address(words)
    return str(v6.ipv4_mapped) if v6.ipv4_mapped else str(v6)


def listening(pid: int) -> list[tuple[str, int]]:
    """The TCP sockets ``pid`` holds in LISTEN: ``(address, port)``; ``0.0.0.0`` and ``::``
    are every interface."""
    inodes = _socket_inodes(pid)
    found: list[tuple[str, int]] = []
    if not inodes:
        return found
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / str(pid) / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10 or f[3] != "0A" or int(f[9]) not in inodes:
                continue
            addr, _, port = f[1].partition(":")
            found.append((_address(addr), int(port, 16)))
    return found
