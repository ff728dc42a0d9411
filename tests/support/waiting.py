"""Polling for a condition in tests that wait on real processes (nodes, a driver, the
database), with a deadline that only bounds how long a failing test hangs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(
    what: str,
    cond: Callable[[], Any],
    timeout_s: float = 120.0,
    detail: Callable[[], Any] | None = None,
) -> Any:
    """``cond()``'s first truthy value, polled every 0.1 s; AssertionError after ``timeout_s``,
    with ``detail()`` (the state that explains the wait) in its message."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := cond():
            return got
        time.sleep(0.1)
    raise AssertionError(
        f"timed out waiting for {what}" + (f"; {detail()}" if detail is not None else "")
    )
