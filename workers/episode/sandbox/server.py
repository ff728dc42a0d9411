"""The tool server's housekeeping: its environment emptied (``scrub_environment``), a call's
output forwarded to its log, escaped (``_forward_output``), and the working directories of calls
removed (``sweep``). Standard library only."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .linux import _write_all

OUTPUT_BYTES = 16 * 1024  # of a call's stdout and stderr, what the node's log gets
WORKDIR_PREFIX = "rollcall-tool-"  # + the server's pid + "-": a call's working directory
OUTPUT_PREFIX = "tool| "  # before each forwarded line of a call's output


_BYTES_DATA = bytes.__basicsize__ - 1  # where a bytes object's data starts (CPython)


# -- the server's environment ---------------------------------------------------------------


def scrub_environment(keep: Iterable[str] = ("PATH", "LANG")) -> None:
    """Drop every environment variable but ``keep`` from this process, overwriting the values
    first (Python's copies, and the environment block the process started with, which is what
    ``/proc/<pid>/environ`` shows): for a process that forks tool processes."""
    kept = {k: os.environ[k] for k in keep if k in os.environ}
    data: Any = getattr(os.environ, "_data", {})
    for value in list(data.values()):
        if isinstance(value, bytes) and len(value) > 1:  # 0 and 1 byte objects are shared
            ctypes.memset(id(value) + _BYTES_DATA, 0, len(value))
    os.environ.clear()
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end (fields 50, 51)
        if 0 < start < end:
            ctypes.memset(start, 0, end - start)
    os.environ.update(kept)


# rollcall.orchestrator.terminal.escape_controls's table (this package imports nothing of
# rollcall's; tests/unit/test_terminal.py holds the two equal)
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0))}


def escape_controls(text: str) -> str:
    """``text`` with each control character but ``\\n`` and ``\\t`` as ``\\xNN``."""
    return text if _CONTROL.search(text) is None else text.translate(_ESCAPES)


def _forward_output(output: Any) -> None:
    """A call's stdout and stderr, its first ``OUTPUT_BYTES``, to this process's stderr (the
    node's log, which an operator reads on a terminal): decoded as UTF-8 (an invalid byte as
    ``\\xNN``), its control characters escaped (``escape_controls``: no ANSI sequence, bell or
    carriage return reaches the terminal) and each line prefixed with ``OUTPUT_PREFIX``, so
    that no line of a tool's can pass for one of rollcall's."""
    with contextlib.suppress(OSError, ValueError), output:
        size = os.fstat(output.fileno()).st_size
        if size:
            output.seek(0)
            head = output.read(OUTPUT_BYTES)
            more = f" (first {OUTPUT_BYTES} of {size} bytes)" if size > OUTPUT_BYTES else ""
            lines = escape_controls(head.decode("utf-8", "backslashreplace")).split("\n")
            if lines[-1] == "":
                lines.pop()
            text = "".join(f"{OUTPUT_PREFIX}{line}\n" for line in lines)
            _write_all(2, f"--- a tool call's output{more}:\n{text}".encode())


@contextlib.contextmanager
def forwarded_output() -> Iterator[None]:
    """Level ``process`` (the tools run in the server): what is written on file descriptors 1
    and 2 inside, the tool's and its subprocesses', goes to a file and is forwarded after, as a
    sandboxed call's is (``_forward_output``), instead of reaching the node's log raw."""
    output = tempfile.TemporaryFile()  # noqa: SIM115 - closed by _forward_output
    saved = [os.dup(1), os.dup(2)]
    _flush()
    try:
        os.dup2(output.fileno(), 1)
        os.dup2(output.fileno(), 2)
        yield
    finally:
        _flush()
        for fd, old in enumerate(saved, start=1):
            os.dup2(old, fd)
            os.close(old)
        _forward_output(output)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # None, closed or replaced by the tool
            stream.flush()


def _remove(path: str) -> None:
    """Remove a call's working directory, whatever the tool did to its modes; nothing outside
    it is touched (a directory already gone is no reason to open up its parent: a chmod of
    ``/tmp`` to 0700 took every non-root process's files away, PostgreSQL's among them)."""
    root = os.path.abspath(path)  # noqa: PTH100 (no symbolic link followed)

    def inside(q: str) -> bool:
        return q == root or q.startswith(root + os.sep)

    def retry(fn: Any, p: str, _exc: Any) -> None:  # a directory the tool made unwritable
        with contextlib.suppress(OSError):
            here = os.path.abspath(p)  # noqa: PTH100 (no symbolic link followed)
            for q in (os.path.dirname(here), here):  # noqa: PTH120
                # never through a symbolic link the tool made, never above the tree
                if inside(q) and stat.S_ISDIR(os.lstat(q).st_mode):
                    os.chmod(q, 0o700)  # noqa: PTH101
            fn(p)

    shutil.rmtree(path, onerror=retry)
    shutil.rmtree(path, ignore_errors=True)


def sweep(workdirs: str) -> list[str]:
    """Remove the working directories that tool servers no longer running left (a server
    killed during a call); what was removed."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in Path(workdirs).iterdir():
            pid, sep, _ = entry.name.removeprefix(WORKDIR_PREFIX).partition("-")
            if not entry.name.startswith(WORKDIR_PREFIX) or not sep or not pid.isdigit():
                continue
            try:
                os.kill(int(pid), 0)
                continue  # its server runs
            except ProcessLookupError:
                pass
            except OSError:
                continue
            if entry.is_dir() and not entry.is_symlink():
                _remove(str(entry))
                removed.append(str(entry))
    return removed
