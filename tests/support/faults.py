"""Fakes at the engine seam, for fault tests: wrappers around a real engine (the tiny model on
hf) that make it slow, hang, fail every call, or start slowly or never. A rollout node applies
one through ``NodeConfig.engine_hook`` ("tests.support.faults:NAME[:ARG]"); Ray's workers
import this module by the driver's ``sys.path``. Behaviours switched on at run time are flag
files in the folder ARG names (the actor runs in another process)."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

from rollcall.workers.episode.engine import (
    Engine,
    EngineHealth,
    Generation,
    GenerationRequest,
)

SLOW_GENERATE_S = 12.0  # longer than the heartbeat timeout (10 s), within progress (30 s)


class _Wrapped:
    """Passes every call to the real engine; subclasses change one behaviour."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.tokenizer = inner.tokenizer
        # one call at a time, weight loads included: a load waits for the running generate
        # call, as in a real engine
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        return self.inner.version

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        with self._lock:
            return self.inner.generate(requests)

    def load_weights(self, version: int, location: str) -> None:
        with self._lock:
            self.inner.load_weights(version, location)

    def health(self) -> EngineHealth:
        return self.inner.health()


class SlowEngine(_Wrapped):
    """Every generate call takes ``SLOW_GENERATE_S`` longer, holding the engine (a load waits
    for it); while the flag file ``hang`` exists in ``flags``, a call does not return (a hung
    engine); once ``fast`` exists, calls are no longer slowed (a test ends sooner). Each slowed
    call's start and end (``time.time()``, one line ``START END`` a call) go to the file
    ``calls`` in ``flags``: a test can tell how many whole slow calls ran within a window (a CPU
    overload's, ``slow_calls_within``)."""

    def __init__(self, inner: Engine, flags: str) -> None:
        super().__init__(inner)
        self.hang = Path(flags) / "hang"
        self.fast = Path(flags) / "fast"
        self.calls = Path(flags) / "calls"

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        with self._lock:
            while self.hang.exists():
                time.sleep(0.2)
            if self.fast.exists():
                return self.inner.generate(requests)
            start = time.time()
            time.sleep(SLOW_GENERATE_S)
            out = self.inner.generate(requests)
            with self.calls.open("a") as f:
                f.write(f"{start} {time.time()}\n")
            return out


class BrokenEngine(_Wrapped):
    """Every generate call raises (not an ``EngineFailure``: an error inside the engine)."""

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (fake)")


def slow(engine: Engine, flags: str) -> Any:
    return SlowEngine(engine, flags)


def broken(engine: Engine) -> Any:
    return BrokenEngine(engine)


def never_starts(engine: Engine) -> Any:
    """The constructor fails every time (as with a bad model path)."""
    raise FileNotFoundError("model folder /nonexistent/model has no config.json (fake)")


LOGPROB_SHIFT = -0.1


class ShiftedLogprobs(_Wrapped):
    """Reports every token's behaviour log-prob ``LOGPROB_SHIFT`` off (as an engine reporting
    the log-probs of another distribution than it sampled from): the trainer's on-policy
    importance weight becomes exp(-LOGPROB_SHIFT), 1.105."""

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        with self._lock:
            gens = self.inner.generate(requests)
        return [
            dataclasses.replace(g, logprobs=[lp + LOGPROB_SHIFT for lp in g.logprobs]) for g in gens
        ]


def shifted_logprobs(engine: Engine) -> Any:
    return ShiftedLogprobs(engine)


class AgentDeath(BaseException):
    """Escapes every ``except Exception``: the agent loop that meets it dies."""


class DeadlyEngine(_Wrapped):
    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        raise AgentDeath("the agent thread dies (fake)")


def deadly(engine: Engine) -> Any:
    return DeadlyEngine(engine)


def slow_calls_within(flags: Path, since: float) -> int:
    """Slow calls of a ``slow`` engine that started at or after ``since`` (``time.time()``)
    and have ended."""
    calls = flags / "calls"
    if not calls.exists():
        return 0
    done = calls.read_text().split("\n")[:-1]  # whole lines only: a write may be under way
    return sum(1 for line in done if float(line.split()[0]) >= since)


SLOW_START_CAP_S = 900.0


def slow_start_until(engine: Engine, flags: str) -> Any:
    """The engine comes up only once the flag file ``go`` exists in ``flags`` (at most
    ``SLOW_START_CAP_S`` late): a test makes the start exactly as slow as it needs, e.g. past
    ``start_timeout_s`` measured as the supervisor measures it."""
    go = Path(flags) / "go"
    deadline = time.monotonic() + SLOW_START_CAP_S
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return engine
