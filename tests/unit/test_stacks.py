"""The sampling CPU profile (orchestrator/stacks.py): CPU is charged to the stacks of the
threads that used it, not to threads that wait."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from rollcall.orchestrator.stacks import StackSampler


def _spin_for(seconds: float) -> int:
    end, n = time.thread_time() + seconds, 0
    while time.thread_time() < end:
        n += 1
    return n


def _sleep_for(seconds: float) -> None:
    time.sleep(seconds)


def test_cpu_goes_to_the_busy_thread_not_the_waiting_one(tmp_path: Path) -> None:
    sampler = StackSampler(interval_s=0.005).start()
    busy = threading.Thread(target=_spin_for, args=(0.4,))
    idle = threading.Thread(target=_sleep_for, args=(1.0,))
    idle.start()
    busy.start()
    busy.join()
    idle.join()
    sampler.stop()
    per_function: dict[str, int] = {}
    for stack, us in sampler.stacks.items():
        for name in set(stack):
            per_function[name] = per_function.get(name, 0) + us
    spin = sum(us for name, us in per_function.items() if name.startswith("_spin_for "))
    sleep = sum(us for name, us in per_function.items() if name.startswith("_sleep_for "))
    assert spin >= 200_000, per_function  # most of the 0.4 s of CPU, even on a busy machine
    assert sleep < spin / 10
    sampler.write(tmp_path, "t")
    assert "_spin_for" in (tmp_path / "t.txt").read_text()
    assert (tmp_path / "t.folded").read_text().splitlines()[0].rsplit(" ", 1)[1].isdigit()
