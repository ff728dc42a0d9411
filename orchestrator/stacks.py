"""A sampling CPU profile of a process's threads: where a rollout node's CPU goes.

Every ``interval_s`` a daemon thread reads each thread's CPU clock
(``pthread_getcpuclockid``) and its Python stack (``sys._current_frames``); the CPU a thread
used since the last sample is charged to its stack at this one. A thread blocked in a lock, a
sleep or a socket uses no CPU and so is charged nothing, whatever its stack. The result is
folded stacks (``frame;frame;... microseconds``, what flame-graph tools read) and the functions
with the most CPU, self and total.

A process opts in with ``ROLLCALL_PROFILE_DIR``: a rollout node started with it set writes
``node-<pid>.folded`` and ``node-<pid>.txt`` there each time its ``run`` returns. The sampler
costs the process a few percent of a core at the default 10 ms.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType

PROFILE_DIR_ENV = "ROLLCALL_PROFILE_DIR"
DEPTH = 40


def _frame_name(f: FrameType) -> str:
    code = f.f_code
    return f"{code.co_qualname} ({Path(code.co_filename).name}:{code.co_firstlineno})"


def _stack(f: FrameType | None) -> tuple[str, ...]:
    out: list[str] = []
    while f is not None and len(out) < DEPTH:
        out.append(_frame_name(f))
        f = f.f_back
    return tuple(reversed(out))


class StackSampler:
    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.stacks: Counter[tuple[str, ...]] = Counter()  # stack -> CPU microseconds
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                try:
                    cpu = time.clock_gettime(time.pthread_getcpuclockid(ident))
                except (OSError, ValueError):  # the thread ended meanwhile
                    continue
                used = cpu - self._last.get(ident, cpu)
                self._last[ident] = cpu
                if used > 0:
                    self.stacks[_stack(frame)] += int(used * 1e6)

    def folded(self) -> str:
        return "".join(f"{';'.join(s)} {us}\n" for s, us in self.stacks.most_common())

    def top(self, n: int = 40) -> str:
        """The functions with the most CPU: self (the stack's last frame) and total."""
        own: Counter[str] = Counter()
        total: Counter[str] = Counter()
        for stack, us in self.stacks.items():
            if stack:
                own[stack[-1]] += us
            for name in set(stack):
                total[name] += us
        all_us = max(1, sum(self.stacks.values()))
        lines = [f"# CPU sampled: {all_us / 1e6:.2f} s", "# self ms  self %  function"]
        lines += [
            f"{us / 1e3:>9.0f} {us / all_us:>7.1%}  {name}" for name, us in own.most_common(n)
        ]
        lines += ["", "# total ms  total %  function"]
        lines += [
            f"{us / 1e3:>10.0f} {us / all_us:>8.1%}  {name}" for name, us in total.most_common(n)
        ]
        return "\n".join(lines) + "\n"

    def write(self, folder: Path, name: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.folded").write_text(self.folded())
        (folder / f"{name}.txt").write_text(self.top())


def sampler_from_env() -> StackSampler | None:
    """A started sampler when ``ROLLCALL_PROFILE_DIR`` is set, else None."""
    return StackSampler().start() if os.environ.get(PROFILE_DIR_ENV) else None


def write_from_env(sampler: StackSampler | None, name: str) -> None:
    """The profile so far, as ``<name>-<pid>`` in ``ROLLCALL_PROFILE_DIR`` (sampling goes on)."""
    if sampler is not None:
        sampler.write(Path(os.environ[PROFILE_DIR_ENV]), f"{name}-{os.getpid()}")
