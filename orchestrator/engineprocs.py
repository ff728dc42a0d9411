"""vLLM's processes as ``/proc`` shows them (``VLLM::EngineCore``, ``VLLM::Worker``...): what the
``vllm`` engine kills when it closes, what the ``kill-engine`` drill signals, and what the
orphan checks look for. Linux; imports nothing of vLLM (nor of the engine), so the control
plane can use it.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Collection

from rollcall.orchestrator import procfs

# vLLM's process names as /proc shows them (a command name is cut at 15 characters)
ENGINE_CORE = "VLLM::EngineCor"


def engine_processes(root: int) -> list[tuple[int, str]]:
    """vLLM's processes (``VLLM::EngineCore``, ``VLLM::Worker``...) descending from ``root``,
    with their names, not counting zombies. Linux (``/proc``)."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for proc in procfs.processes():
        if proc.zombie:
            continue
        names[proc.pid] = proc.name
        children.setdefault(proc.ppid, []).append(proc.pid)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            if names[child].startswith("VLLM"):
                found.append((child, names[child]))
    return sorted(found)


def all_engine_processes() -> list[tuple[int, str]]:
    """Every live (not zombie) vLLM process on this machine, with its name: orphan checks."""
    return sorted(
        (p.pid, p.name) for p in procfs.processes() if p.name.startswith("VLLM") and not p.zombie
    )


def kill_engine_processes(pids: Collection[int] = ()) -> None:
    """SIGKILL what is left of vLLM's processes: ``pids`` and any under this one."""
    for pid in {*pids, *(p for p, _ in engine_processes(os.getpid()))}:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
