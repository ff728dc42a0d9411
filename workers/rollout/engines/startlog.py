"""What vLLM's processes wrote while an engine started: the root cause of a failed start.

vLLM's EngineCore and its worker are child processes of the node and inherit its standard
output and error. When the EngineCore fails to start, the root cause goes there, not into the
exception the node sees: the worker and the EngineCore log it through vLLM's logger ("WorkerProc
failed to start.", "EngineCore failed to start." and the traceback, at ERROR level, on standard
output unless ``VLLM_LOGGING_STREAM`` says otherwise), and the EngineCore process prints its
traceback on standard error as it exits (multiprocessing). The frontend then raises only
``RuntimeError("Engine core initialization failed. See root cause above. ...")``.

Under Ray a worker's standard output and error end in files (``worker-*.out`` and
``worker-*.err`` in the session's ``logs/``; under pytest, its capture file). Without log
rotation they are those files; with it (``RAY_ROTATION_MAX_BYTES``, which the driver's local
Ray sets, ``orchestrator/runner/raystart.py``) they are pipes, and Ray's logger copies what
comes through them into the files (``ray_worker_logs`` names them). ``OutputMark`` notes the
files' sizes before the start and reads back what was written since (at most ``READ_BYTES``
of each; through a pipe, once the file has stopped growing for ``SETTLE_S``);
``start_error`` picks from it the error lines (vLLM's ERROR lines, tracebacks, exception lines)
and the root cause (the first exception line: vLLM logs the original error before the
processes above it fail in turn), and builds the ``EngineStartError`` the engine raises, its
message ending in one line that names the root cause (the supervisor's restart line takes the
last line) and carrying at most ``MAX_LINES`` lines of evidence, ``MAX_BYTES`` in all. A stream
that is not a regular file and not Ray's pipe (a terminal, a pipe of the user's) cannot be read
back: the error then says so.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

READ_BYTES = 256 * 1024  # read back at most this much of what each stream got during a start
MAX_LINES = 40  # evidence kept in the error: the last error lines ...
MAX_BYTES = 4096  # ... at most this many bytes of them
LINE_CHARS = 400  # one line of evidence at most
SETTLE_S = 0.5  # a file written through Ray's pipe is read once it grew no more for this long
SETTLE_MAX_S = 5.0  # ... or after this long in all

# vLLM's prefix for a child process's lines: "(EngineCore pid=23156) " / "(Worker pid=23207) "
_WHO = re.compile(r"^(\([\w.-]+ pid=\d+\) )")
# vLLM's log line: "ERROR 12-06 13:01:05 [core.py:1510] message"
_LEVEL = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d [\d:.]+ \[[^\]]*\] ?(.*)$")
# an exception's own line: "ValueError: ...", "safetensors_rust.SafetensorError: ..."
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)(: .*)?$")
_CARETS = re.compile(r"^\s*[\^~]+\s*$")  # Python 3.11's markers under a frame's code


class EngineStartError(RuntimeError):
    """The engine did not start: ``cause`` is the root cause found in what vLLM's processes
    wrote (or the exception's own line when none was found), ``output`` the evidence."""

    def __init__(self, message: str, cause: str = "", output: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.cause = cause
        self.output = output

    def __reduce__(self) -> tuple[Any, ...]:  # Ray pickles it with these fields
        return (type(self), (str(self), self.cause, self.output))


@dataclass(frozen=True)
class _Stream:
    name: str
    where: str  # the file's path (read back by a new open of it)
    file: tuple[int, int]  # (device, inode): the same file when read back
    offset: int
    piped: bool  # written through a pipe by another process: it may lag behind


class OutputMark:
    """This process's standard output and error that end in files (regular files, or Ray's
    pipes to its worker's log files), and the files' sizes now."""

    def __init__(self) -> None:
        self.streams: list[_Stream] = []
        logs = ray_worker_logs()
        for fd, name in ((1, "stdout"), (2, "stderr")):
            try:
                st = os.fstat(fd)
            except OSError:
                continue
            where, piped = f"/proc/self/fd/{fd}", False  # a new open: the fd may be write-only
            if not stat.S_ISREG(st.st_mode):
                if not (stat.S_ISFIFO(st.st_mode) and logs.get(name)):
                    continue
                where, piped = logs[name], True
                try:
                    st = Path(where).stat()
                except OSError:
                    continue
            file = (st.st_dev, st.st_ino)
            if all(s.file != file for s in self.streams):
                self.streams.append(_Stream(name, where, file, st.st_size, piped))

    def written(self) -> list[tuple[str, str]]:
        """(stream name, text) of what each stream got since the mark (at most its last
        ``READ_BYTES``), standard output first."""
        if any(s.piped for s in self.streams):
            _settle([s.where for s in self.streams if s.piped])
        out = []
        for s in self.streams:
            try:
                with open(s.where, "rb") as f:
                    st = os.fstat(f.fileno())
                    size = st.st_size
                    if (st.st_dev, st.st_ino) == s.file:
                        start = s.offset if size >= s.offset else 0  # truncated: read it all
                    elif s.piped:
                        start = 0  # Ray rotated it: what came since is in the new file
                    else:
                        continue  # the fd was pointed elsewhere since
                    f.seek(max(start, size - READ_BYTES))
                    data = f.read(READ_BYTES)
            except OSError:
                continue
            out.append((s.name, data.decode("utf-8", "replace")))
        return out

    def where(self) -> str:
        """Which files the streams end in: "stdout: PATH, stderr: PATH"."""
        return ", ".join(f"{s.name}: {_path(s.where)}" for s in self.streams)


def ray_worker_logs() -> dict[str, str]:
    """The files Ray writes this worker process's standard output and error to, by stream
    name; none outside a Ray worker (and Ray is not imported for the asking)."""
    worker_module = sys.modules.get("ray._private.worker")
    worker = getattr(worker_module, "global_worker", None)
    if worker is None:
        return {}
    try:
        paths = {"stdout": worker.get_out_file_path(), "stderr": worker.get_err_file_path()}
    except Exception:  # Ray's own helpers; a version without them: no files
        return {}
    return {name: str(path) for name, path in paths.items() if path}


def _settle(paths: list[str]) -> None:
    """Wait until these files grew no more for ``SETTLE_S`` (at most ``SETTLE_MAX_S``): what
    vLLM's processes wrote into Ray's pipe before they ended is in the file then."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()

    def sizes() -> list[int]:
        out = []
        for path in paths:
            try:
                out.append(Path(path).stat().st_size)
            except OSError:
                out.append(-1)
        return out

    deadline = time.monotonic() + SETTLE_MAX_S
    last, since = sizes(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = sizes()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= SETTLE_S:
            return


def error_lines(text: str) -> list[str]:
    """The lines of ``text`` that tell of an error: vLLM's ERROR and CRITICAL lines (with the
    process they came from), tracebacks and exception lines; without Python's caret lines."""
    kept: list[str] = []
    in_traceback = False
    previous = ""
    for raw in text.splitlines():
        line = raw.rsplit("\r", 1)[-1].rstrip()  # a progress bar's last state
        who_match = _WHO.match(line)
        who = who_match.group(1) if who_match else ""
        rest = line[len(who) :]
        level = _LEVEL.match(rest)
        if level is not None:
            message = level.group(2)
            error = level.group(1) in ("ERROR", "CRITICAL")
            if error and message.strip() and not _CARETS.match(message):
                kept.append(f"{who}{message}"[:LINE_CHARS])
            in_traceback = False
        elif rest.startswith("Traceback (most recent call last)"):
            if previous.startswith("Process ") and previous.endswith(":"):
                kept.append(previous)  # multiprocessing's "Process EngineCore:"
            kept.append(line)
            in_traceback = True
        elif _EXCEPTION.match(rest):
            kept.append(line[:LINE_CHARS])
            in_traceback = False
        elif in_traceback and line and not _CARETS.match(line):
            kept.append(line[:LINE_CHARS])
        previous = line
    return kept


def root_cause(lines: list[str]) -> str | None:
    """The first exception line, without vLLM's process prefix: the original error (vLLM logs
    it before the processes above it fail in turn, each with an error of its own)."""
    for line in lines:
        rest = line[m.end() :] if (m := _WHO.match(line)) else line
        if _EXCEPTION.match(rest):
            return rest
    return None


def evidence(lines: list[str]) -> list[str]:
    """The last ``MAX_LINES`` lines, at most ``MAX_BYTES`` in all."""
    tail = lines[-MAX_LINES:]
    while tail and sum(len(line) + 1 for line in tail) > MAX_BYTES:
        tail = tail[1:]
    return tail


def start_error(error: BaseException, mark: OutputMark, what: str = "vLLM") -> EngineStartError:
    """The error for a start that raised ``error``, with what vLLM's processes wrote since
    ``mark``. Its message is the evidence, then one line: the root cause, then ``error``."""
    text = str(error).strip()
    said = f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
    lines = [line for _, text in mark.written() for line in error_lines(text)]
    cause = root_cause(lines)
    kept = evidence(lines)
    if not mark.streams:
        head = (
            f"{what}'s processes wrote to no file this process can read back (standard output "
            "and error are not files): the root cause is in their terminal or pipe"
        )
    elif not kept:
        head = f"{what}'s processes wrote no error line while it started"
    else:
        head = f"{what}'s processes wrote, while it started ({mark.where()}):\n" + "\n".join(
            f"  | {line}" for line in kept
        )
    last = f"{cause} ({what} did not start: {said})" if cause else f"{what} did not start: {said}"
    return EngineStartError(f"{head}\n{last}", cause or said, tuple(kept))


def _path(where: str) -> str:
    if not where.startswith("/proc/self/fd/"):
        return where
    try:
        return str(Path(where).readlink()).removesuffix(" (deleted)")
    except OSError:
        return where
