"""Processes as Linux's ``/proc`` shows them: one parse of ``/proc/PID/stat`` for every place
that needs a process's state, parent or name (the engine's watchdog and orphan checks, the
drills, the embedded PostgreSQL, benchmarks and tests). Depends on nothing in the project."""

from __future__ import annotations

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
