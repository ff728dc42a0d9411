"""The tool server's housekeeping: its environment emptied (``scrub_environment``), a call's
output forwarded to its log, and the working directories of calls removed (``sweep``).
Standard library only."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .linux import _write_all

OUTPUT_BYTES = 16 * 1024  # of a call's stdout and stderr, what the node's log gets
WORKDIR_PREFIX = "rollcall-tool-"  # + the server's pid + "-": a call's working directory


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


def _forward_output(output: Any) -> None:
    """A call's stdout and stderr, its first ``OUTPUT_BYTES``, to this process's stderr."""
    with contextlib.suppress(OSError, ValueError), output:
        size = os.fstat(output.fileno()).st_size
        if size:
            output.seek(0)
            head = output.read(OUTPUT_BYTES)
            more = f" (first {OUTPUT_BYTES} of {size} bytes)" if size > OUTPUT_BYTES else ""
            note = f"--- a tool call's output{more}:\n".encode()
            _write_all(2, note + head + (b"" if head.endswith(b"\n") else b"\n"))


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
