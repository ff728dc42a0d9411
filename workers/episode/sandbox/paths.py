"""A call's limits (``Limits``), and what its mount namespace covers and binds back
(``Layout``, ``layout``). Standard library only."""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollcall.orchestrator.config import ToolSandboxConfig


# what a call's mount namespace replaces with a fresh, private tmpfs of its own (where they
# exist): world-writable directories, and where the node's user has its sockets
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm", "/run/user")


# -- limits and what the kernel allows ------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """``rollout.tool_sandbox`` as plain data (the tool server imports no config)."""

    level: str = "sandbox"
    cpu_s: int = 10
    memory_mb: int = 1024
    processes: int = 64
    open_files: int = 256
    file_mb: int = 64

    @classmethod
    def of(cls, config: ToolSandboxConfig | None, memory_mb: int | None = None) -> Limits:
        base = cls()
        if config is not None:
            base = cls(
                config.level, config.cpu_s, config.memory_mb, config.processes,
                config.open_files, config.file_mb,
            )  # fmt: skip
        return base if memory_mb is None else replace(base, memory_mb=memory_mb)

    def cpu_message(self) -> str:
        return f"the tool used its {self.cpu_s} s of CPU"

    def memory_message(self) -> str:
        return f"the tool's processes used more than their {self.memory_mb} MiB of memory"

    def file_message(self) -> str:
        return f"the tool wrote past its {self.file_mb} MiB file limit"


@dataclass(frozen=True)
class Layout:
    """What a call's mount namespace covers (``hide``: directories, ``hide_files``: files) and
    what it binds back read-only from under them (``keep``: the interpreter's paths)."""

    hide: tuple[str, ...] = ()
    hide_files: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()
    needed: tuple[str, ...] = ()  # every path of the interpreter's (``keep``: those covered)
    workdirs: str = "/tmp"  # where each call's working directory is made (never covered)
    scratch: tuple[str, ...] = ()  # replaced by a fresh tmpfs (``SCRATCH`` that exist)


def layout(
    environ: Any = None, *, cwd: str | None = None, path: Iterable[str] | None = None
) -> Layout:
    """The node's: from its environment and interpreter (call it before dropping either).
    ``cwd`` and ``path`` (default: the process's, ``sys.path``) for tests.

    Hidden: ``HOME``, ``ROLLCALL_HOME`` (also where nested in ``HOME``), Ray's temporary
    directory, PostgreSQL's socket directories, Ray's token file. Bound back read-only from
    under them: the interpreter's prefixes, ``sys.path`` without the working directory (``''``
    or the cwd: Ray adds the driver's), and this project's root; never a path equal to or
    above a hidden one (that would bind the secrets back)."""
    env = os.environ if environ is None else environ
    cwd = _real(str(Path.cwd()) if cwd is None else cwd)
    entries = list(sys.path if path is None else path)
    home = env.get("HOME") or _home()
    rollcall_home = env.get("ROLLCALL_HOME") or (home and str(Path(home) / ".rollcall"))
    ray_tmp = [
        str(Path(d) / "ray") for d in {env.get("RAY_TMPDIR"), env.get("TMPDIR"), "/tmp"} if d
    ]
    pg_sockets = sorted(str(p) for p in Path("/tmp").glob("rollcall-pg-*"))
    workdirs = _real(tempfile.gettempdir())
    never = {"/", _real("/tmp"), workdirs}

    def coverable(p: str) -> bool:  # never / nor a directory that holds the working directories
        return p not in never and not _under(workdirs, p) and Path(p).is_dir()

    candidates = [p for p in (home, rollcall_home, *ray_tmp, *pg_sockets) if p]
    hide = tuple(sorted({p for p in map(_real, candidates) if coverable(p)}))  # nested kept
    scratch = _top_level(p for p in map(_real, SCRATCH) if p != "/" and Path(p).is_dir())
    token = env.get("RAY_AUTH_TOKEN_PATH")
    hide_files = tuple(
        p
        for p in ([_real(token)] if token else [])
        if Path(p).is_file() and not _covered(p, (*hide, *scratch))
    )
    project = str(Path(__file__).resolve().parents[3])  # this project's packages
    needed = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
              str(Path(sys.executable).parent), project}  # fmt: skip
    needed |= {p for p in entries if p and _real(p) != cwd}
    tops = (*_top_level(hide), *scratch)
    real = {_real(p) for p in needed}
    safe = (p for p in real if Path(p).exists() and not any(_under(t, p) for t in tops))
    paths = _top_level(safe)
    keep = tuple(p for p in paths if _covered(p, tops))
    return Layout(hide, hide_files, keep, paths, workdirs, scratch)


def _home() -> str:
    """The user's home directory from the password database ("" for a uid without one)."""
    try:
        return str(Path("~").expanduser())
    except RuntimeError:
        return ""


def _real(p: str) -> str:
    return str(Path(p).resolve())


def _under(p: str, d: str) -> bool:
    return p == d or p.startswith(d.rstrip("/") + "/")


def _covered(p: str, dirs: Iterable[str]) -> bool:
    return any(_under(p, d) for d in dirs)


def _top_level(paths: Iterable[str]) -> tuple[str, ...]:
    """``paths`` without those under another of them, sorted."""
    out: list[str] = []
    for p in sorted(set(paths)):
        if not _covered(p, out):
            out.append(p)
    return tuple(out)


def _reachable(paths: Iterable[str]) -> bool:
    """Can a user with no access of its own (others' permission bits) reach each of ``paths``
    and read it? (What a uid of a call's own needs of the interpreter's files.)"""
    for p in paths:
        path = Path(p)
        try:
            for d in [*reversed(path.parents), *([path] if path.is_dir() else [])]:
                if not d.stat().st_mode & stat.S_IXOTH:
                    return False
            if not path.stat().st_mode & stat.S_IROTH:
                return False
        except OSError:
            return False
    return True
