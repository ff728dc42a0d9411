"""``ops.chaos.BusyLoops``, the CPU overload of the chaos drills and the liveness test: the
loops run until ``end``, and a start that fails part-way leaves none of the started ones
running (they used to spin on, outside any ``with`` block, until the test session ended)."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from ops import chaos
from ops.chaos import BusyLoops


def test_the_loops_run_until_the_end() -> None:
    with BusyLoops(2) as loops:
        assert loops.n == 2 and all(p.poll() is None for p in loops.procs)
    assert all(p.poll() is not None for p in loops.procs)


def test_a_failed_start_ends_the_loops_already_started(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[subprocess.Popen[bytes]] = []
    real = subprocess.Popen

    def popen_failing_third(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        """A fake at the seam: the third process start fails (no process table room)."""
        if len(started) == 2:
            raise OSError(11, "Resource temporarily unavailable")
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(chaos.subprocess, "Popen", popen_failing_third)
    try:
        with pytest.raises(OSError):
            BusyLoops(4)
        assert len(started) == 2 and all(p.poll() is not None for p in started)
    finally:
        for p in started:
            p.kill()
            p.wait()
