"""A sampling CPU profile of a process's threads: where a rollout node's CPU goes.

Every ``interval_s`` a daemon thread reads each thread's state (``/proc/TID/stat``)
and its Python stack (``sys._current_frames``): a thread on a CPU or waiting for one (state
``R``) is charged the time since the last sample at that stack; a thread blocked in a lock, a
sleep or a socket is charged nothing. The result is folded stacks (``frame;frame;...
microseconds``, what flame-graph tools read) and the functions with the most CPU, self and
total.

A process opts in with ``ROLLCALL_PROFILE_DIR``: a rollout node started with it set writes
``node-<pid>.folded`` and ``node-<pid>.txt`` there every 20 s and when its ``run`` returns. The
sampler costs the process a few percent of a core at the default 10 ms.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType

from rollcall.orchestrator import procfs

log = logging.getLogger(__name__)

PROFILE_DIR_ENV = "ROLLCALL_PROFILE_DIR"
DEPTH = 40


def _frame_name(f: FrameType) -> str:
    code = f.f_code
    return f"{code.co_qualname} ({Path(code.co_filename).name}:{code.co_firstlineno})"


def _running(tid: int) -> bool:
    """Whether the thread is on a CPU or waiting for one (state R), not blocked (a thread's
    ``/proc/TID/stat``, as a process's)."""
    st = procfs.stat(tid)
    return st is not None and st.state == "R"


def _stack(f: FrameType | None) -> tuple[str, ...]:
    out: list[str] = []
    while f is not None and len(out) < DEPTH:
        out.append(_frame_name(f))
        f = f.f_back
    return tuple(reversed(out))


class StackSampler:
    def __init__(
        self, interval_s: float = 0.01, out: Path | None = None, write_every_s: float = 20.0
    ) -> None:
        """``out``: a path (without suffix) the profile so far is written to every
        ``write_every_s`` (a process killed at its end keeps its last one)."""
        self.interval_s = interval_s
        self.out, self.write_every_s = out, write_every_s
        self.stacks: Counter[tuple[str, ...]] = Counter()  # stack -> CPU microseconds
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
        written = time.monotonic()
        last = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            step_us, last = int((now - last) * 1e6), now  # the GIL may delay a sample
            if self.out is not None and time.monotonic() - written > self.write_every_s:
                write_from_env(self)
                written = time.monotonic()
            native = {t.ident: t.native_id for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                tid = native.get(ident)
                if ident == me or tid is None or not _running(tid):
                    continue
                self.stacks[_stack(frame)] += step_us

    def _snapshot(self) -> dict[tuple[str, ...], int]:
        return dict(self.stacks)  # one C-level copy: the sampler thread may add stacks meanwhile

    def folded(self) -> str:
        stacks = sorted(self._snapshot().items(), key=lambda kv: -kv[1])
        return "".join(f"{';'.join(s)} {us}\n" for s, us in stacks)

    def top(self, n: int = 40) -> str:
        """The functions with the most CPU: self (the stack's last frame) and total."""
        own: Counter[str] = Counter()
        total: Counter[str] = Counter()
        snapshot = self._snapshot()
        for stack, us in snapshot.items():
            if stack:
                own[stack[-1]] += us
            for name in set(stack):
                total[name] += us
        all_us = max(1, sum(snapshot.values()))
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


def sampler_from_env(name: str) -> StackSampler | None:
    """When ``ROLLCALL_PROFILE_DIR`` is set, a started sampler that writes ``<name>-<pid>``
    there every 20 s and at ``write_from_env``; else None."""
    folder = os.environ.get(PROFILE_DIR_ENV)
    if not folder:
        return None
    return StackSampler(out=Path(folder) / f"{name}-{os.getpid()}").start()


def write_from_env(sampler: StackSampler | None) -> None:
    """The profile so far (sampling goes on); a failure to write it is logged, never raised
    into the caller's work."""
    if sampler is not None and sampler.out is not None:
        try:
            sampler.write(sampler.out.parent, sampler.out.name)
        except Exception as e:
            log.warning("could not write the CPU profile to %s: %s", sampler.out, e)
