"""What vLLM's processes wrote while an engine started: the root cause of a failed start.

vLLM's EngineCore and its worker are child processes of the node and inherit its standard
output and error. When the EngineCore fails to start, the root cause goes there, not into the
exception the node sees: the worker and the EngineCore log it through vLLM's logger ("WorkerProc
failed to start.", "EngineCore failed to start." and the traceback, at ERROR level, on standard
output unless ``VLLM_LOGGING_STREAM`` says otherwise), and the EngineCore process prints its
traceback on standard error as it exits (multiprocessing). The frontend then raises only
``RuntimeError("Engine core initialization failed. See root cause above. ...")``.

Under Ray a worker's standard output and error are files (``worker-*.out`` and ``worker-*.err``
in the session's ``logs/``; under pytest, its capture file). ``OutputMark`` notes their sizes
before the start and reads back what was written since (at most ``READ_BYTES`` of each);
``start_error`` picks from it the error lines (vLLM's ERROR lines, tracebacks, exception lines)
and the root cause (the first exception line: vLLM logs the original error before the
processes above it fail in turn), and builds the ``EngineStartError`` the engine raises, its
message ending in one line that names the root cause (the supervisor's restart line takes the
last line) and carrying at most ``MAX_LINES`` lines of evidence, ``MAX_BYTES`` in all. A stream
that is not a regular file (a terminal, a pipe) cannot be read back: the error then says so.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

READ_BYTES = 256 * 1024  # read back at most this much of what each stream got during a start
MAX_LINES = 40  # evidence kept in the error: the last error lines ...
MAX_BYTES = 4096  # ... at most this many bytes of them
LINE_CHARS = 400  # one line of evidence at most

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
    fd: int
    file: tuple[int, int]  # (device, inode): the same file when read back
    offset: int


class OutputMark:
    """This process's standard output and error that are regular files, and their sizes now."""

    def __init__(self) -> None:
        self.streams: list[_Stream] = []
        for fd, name in ((1, "stdout"), (2, "stderr")):
            try:
                st = os.fstat(fd)
            except OSError:
                continue
            file = (st.st_dev, st.st_ino)
            if stat.S_ISREG(st.st_mode) and all(s.file != file for s in self.streams):
                self.streams.append(_Stream(name, fd, file, st.st_size))

    def written(self) -> list[tuple[str, str]]:
        """(stream name, text) of what each stream got since the mark (at most its last
        ``READ_BYTES``), standard output first."""
        out = []
        for s in self.streams:
            try:
                # a new open of the same file: the fd itself may be write-only
                with open(f"/proc/self/fd/{s.fd}", "rb") as f:
                    st = os.fstat(f.fileno())
                    if (st.st_dev, st.st_ino) != s.file:
                        continue  # the fd was pointed elsewhere since
                    size = st.st_size
                    start = s.offset if size >= s.offset else 0  # truncated: read it all
                    f.seek(max(start, size - READ_BYTES))
                    data = f.read(READ_BYTES)
            except OSError:
                continue
            out.append((s.name, data.decode("utf-8", "replace")))
        return out


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
        where = ", ".join(f"{s.name}: {_path(s.fd)}" for s in mark.streams)
        head = f"{what}'s processes wrote, while it started ({where}):\n" + "\n".join(
            f"  | {line}" for line in kept
        )
    last = f"{cause} ({what} did not start: {said})" if cause else f"{what} did not start: {said}"
    return EngineStartError(f"{head}\n{last}", cause or said, tuple(kept))


def _path(fd: int) -> str:
    try:
        return str(Path(f"/proc/self/fd/{fd}").readlink()).removesuffix(" (deleted)")
    except OSError:
        return f"fd {fd}"
