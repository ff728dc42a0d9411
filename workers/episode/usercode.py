"""User code that failed on an episode's input: the episode's failure, never the node's.

User code is whatever the user brought: an agent function, the tools it runs, a reward or a
judge, a task plugin's reward and prompt handling. When it raises, returns a reward that is not
a finite number, returns the wrong type or does not finish within the episode's timeout, the
runtime raises ``UserCodeError``. The rollout node then releases the episode as its input's
fault (retried with backoff, quarantined after the task's attempts), never counts it toward its
own breaker or restart budget, and records an ``episode.user_error`` event whose payload holds
the one-line error, where in the user's code it happened (``location``: the innermost frame in
the user's files, ``file:line in function``), the traceback with the user's frames first, and a
``signature`` (the error's type and location) by which the driver and ``rollcall status``
count occurrences of the same fault.

A frame is the user's when its file lies outside rollcall's runtime packages (``workers``,
``orchestrator``), Python's standard library and installed third-party packages; the built-in
task plugins (``tasks``) count as the user's. Paths under the working directory are shown
relative to it.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

# Bounds on what one event carries: a traceback of a deep recursion, a message of megabytes.
MAX_MESSAGE = 500
MAX_TRACEBACK = 8000

_ROOT = Path(__file__).resolve().parents[2]  # where the workers and orchestrator packages are
_RUNTIME = tuple(str(_ROOT / package) + os.sep for package in ("workers", "orchestrator"))
_LIBRARIES = tuple(
    sorted(
        {
            str(Path(p).resolve()) + os.sep
            for key in ("stdlib", "platstdlib", "purelib", "platlib")
            if (p := sysconfig.get_paths().get(key))
        }
    )
)


def _is_user_file(filename: str) -> bool:
    if not filename or filename.startswith("<"):
        return False
    path = os.path.realpath(filename)
    return not path.startswith(_RUNTIME) and not path.startswith(_LIBRARIES)


def _shown(filename: str) -> str:
    """A path as the user would type it: relative to the working directory when under it."""
    try:
        rel = os.path.relpath(filename)
    except ValueError:  # another drive
        return filename
    return filename if rel.startswith("..") else rel


def _where(filename: str, line: int | None, name: str) -> str:
    return f"{_shown(filename)}:{line if line is not None else '?'} in {name}"


def _frames(error: BaseException) -> list[traceback.FrameSummary]:
    return list(traceback.extract_tb(error.__traceback__))


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= MAX_MESSAGE else line[: MAX_MESSAGE - 3] + "..."


def stack_location(frames: list[traceback.FrameSummary]) -> str:
    """The innermost of ``frames`` in the user's files (``file:line in name``), or ``""``."""
    user = [f for f in frames if _is_user_file(f.filename)]
    return _where(user[-1].filename, user[-1].lineno, user[-1].name) if user else ""


def describe(error: BaseException) -> str:
    """``Type: message`` on one line, bounded."""
    text = str(error)
    return _one_line(f"{type(error).__name__}: {text}" if text else type(error).__name__)


def code_location(fn: Any) -> str:
    """Where a function is defined (``file:line in name``), or its name when that is unknown."""
    target = getattr(fn, "__func__", fn)
    target = getattr(target, "__wrapped__", target)
    code = getattr(target, "__code__", None)
    if code is None:
        call = getattr(type(fn), "__call__", None)  # noqa: B004 - a callable object
        code = getattr(call, "__code__", None)
    if code is None:
        return getattr(fn, "__qualname__", type(fn).__qualname__)
    return _where(code.co_filename, code.co_firstlineno, code.co_name)


class UserCodeError(Exception):
    """User code failed on this episode's input (see the module's docstring).

    ``message`` is one line naming what failed (``the agent raised RuntimeError: ...``,
    ``the agent's reward nan is not a finite number``); ``location`` the innermost frame in
    the user's own files (or where the function is defined, for a bad return value);
    ``input_independent`` marks a programming error that fails on every input alike (a wrong
    return type, a function that cannot be called as ``fn(ctx, prompt)``): its task is paused
    at the first occurrence."""

    def __init__(
        self,
        message: str,
        *,
        location: str = "",
        trace: str = "",
        kind: str = "raised",
        head: str = "",
        input_independent: bool = False,
    ) -> None:
        self.message = _one_line(message)
        # what failed without the input's details (the message often names the input): the
        # same fault has one head and location, whatever the input
        self.head = _one_line(head) if head else self.message
        self.location = location
        self.trace = trace[-MAX_TRACEBACK:] if len(trace) > MAX_TRACEBACK else trace
        self.kind = kind  # raised, reward, returned, timeout
        self.input_independent = input_independent
        super().__init__(f"{self.message} ({location})" if location else self.message)

    @classmethod
    def raised(
        cls,
        who: str,
        error: BaseException,
        fallback: Any = None,
        *,
        input_independent: bool = False,
    ) -> UserCodeError:
        """``who`` (``the agent``, ``the task's reward``) raised ``error``; where: the innermost
        frame in the user's files, else where ``fallback`` (the function) is defined."""
        user = [f for f in _frames(error) if _is_user_file(f.filename)]
        location = stack_location(user)
        if not location and fallback is not None:
            location = code_location(fallback)
        return cls(
            f"{who} raised {describe(error)}",
            location=location,
            trace=user_traceback(error),
            kind="raised",
            head=f"{who} raised {type(error).__name__}",
            input_independent=input_independent,
        )

    @property
    def signature(self) -> str:
        """The same fault, whatever the input: what failed and where."""
        return hashlib.sha256(f"{self.head}|{self.location}".encode()).hexdigest()[:12]

    def payload(self) -> dict[str, Any]:
        return {
            "error": self.message,
            "head": self.head,
            "location": self.location,
            "traceback": self.trace,
            "signature": self.signature,
            "kind": self.kind,
            "input_independent": self.input_independent,
        }


def user_traceback(error: BaseException) -> str:
    """The frames in the user's files first (innermost last) with the exception's line, then
    the whole traceback as Python prints it."""
    frames = _frames(error)
    user = [f for f in frames if _is_user_file(f.filename)]
    last = "".join(traceback.format_exception_only(type(error), error)).rstrip()
    full = "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip()
    if not user:
        return full
    mine = "".join(traceback.format_list(user)).rstrip()
    return f"in your code (innermost last):\n{mine}\n{last}\n\nthe whole traceback:\n{full}"


def check_reward(value: Any, who: str, fn: Any) -> float:
    """``value`` as a float when it is a finite real number; else ``UserCodeError`` (the
    input's fault: a judge that returned garbage, a division by zero that made NaN)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise UserCodeError(
            f"{who} {_one_line(repr(value))[:80]} is not a number",
            location=code_location(fn),
            kind="reward",
            head=f"{who} is not a number",
        )
    reward = float(value)
    if not math.isfinite(reward):
        raise UserCodeError(
            f"{who} {reward} is not a finite number",
            location=code_location(fn),
            kind="reward",
            head=f"{who} is not a finite number",
        )
    return reward


def user_call(who: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, its exception raised as ``UserCodeError`` (``who`` raised)."""
    try:
        return fn(*args, **kwargs)
    except UserCodeError:
        raise
    except Exception as e:
        raise UserCodeError.raised(who, e, fn) from e


def check_json(value: Any, who: str, fn: Any) -> None:
    """``value`` must go into PostgreSQL's ``jsonb``: JSON, numbers finite (else the checkpoint
    that stores it would fail, as the node's failure)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise UserCodeError(
            f"{who} must be JSON with finite numbers ({e})",
            location=code_location(fn),
            kind="returned",
            head=f"{who} is not JSON",
        ) from None
