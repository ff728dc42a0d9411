"""What the control plane costs the process that calls it: wall and CPU time per buffer
operation.

Every public buffer operation is ``@timed``: its calls, wall seconds (retries included)
and the calling thread's CPU seconds (``time.thread_time``: the client's own work, not the
database server's) add up in the buffer's ``OpTimings``, with a latency histogram of fixed
log-spaced buckets. Counters only grow, so two snapshots subtract into the figures of the
interval between them (``diff``), and percentiles come from the bucket counts. Operations
called from inside another timed operation count only in the outer one.

The cost is two clock reads and a lock per operation (about a microsecond).
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

BUCKETS_PER_DECADE = 20
LOWEST_S = 1e-5  # bucket 0: everything below 10 microseconds
BUCKETS = 7 * BUCKETS_PER_DECADE + 1  # up to 100 s, then one overflow bucket


def bucket_of(seconds: float) -> int:
    if seconds <= LOWEST_S:
        return 0
    return min(BUCKETS, 1 + int(math.log10(seconds / LOWEST_S) * BUCKETS_PER_DECADE))


def bucket_upper_s(index: int) -> float:
    """The upper edge of bucket ``index`` (what a percentile reports)."""
    return LOWEST_S * 10 ** (index / BUCKETS_PER_DECADE)


class OpTimings:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ops: dict[str, dict[str, Any]] = {}

    def record(self, name: str, wall_s: float, cpu_s: float) -> None:
        with self._lock:
            op = self._ops.get(name)
            if op is None:
                op = self._ops[name] = {
                    "calls": 0,
                    "wall_s": 0.0,
                    "cpu_s": 0.0,
                    "hist": [0] * (BUCKETS + 1),
                }
            op["calls"] += 1
            op["wall_s"] += wall_s
            op["cpu_s"] += cpu_s
            op["hist"][bucket_of(wall_s)] += 1

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per operation: calls, wall_s, cpu_s (cumulative) and the histogram's counts."""
        with self._lock:
            return {k: {**v, "hist": list(v["hist"])} for k, v in self._ops.items()}


def diff(
    after: Mapping[str, Mapping[str, Any]], before: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The figures of the interval between two snapshots (of one process)."""
    out = {}
    for name, a in after.items():
        b = before.get(name)
        if b is None:
            out[name] = {**a, "hist": list(a["hist"])}
            continue
        out[name] = {
            "calls": a["calls"] - b["calls"],
            "wall_s": a["wall_s"] - b["wall_s"],
            "cpu_s": a["cpu_s"] - b["cpu_s"],
            "hist": [x - y for x, y in zip(a["hist"], b["hist"], strict=True)],
        }
    return out


def merge(snapshots: Sequence[Mapping[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Several processes' figures added together."""
    out: dict[str, dict[str, Any]] = {}
    for snap in snapshots:
        for name, v in snap.items():
            o = out.setdefault(
                name, {"calls": 0, "wall_s": 0.0, "cpu_s": 0.0, "hist": [0] * (BUCKETS + 1)}
            )
            o["calls"] += v["calls"]
            o["wall_s"] += v["wall_s"]
            o["cpu_s"] += v["cpu_s"]
            o["hist"] = [x + y for x, y in zip(o["hist"], v["hist"], strict=True)]
    return out


def percentile_s(hist: list[int], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of the latencies counted in ``hist`` (bucket upper
    edges: at most one bucket, 12%, above the true value)."""
    total = sum(hist)
    if total == 0:
        return None
    rank = math.ceil(q / 100 * total)
    seen = 0
    for i, n in enumerate(hist):
        seen += n
        if seen >= max(1, rank):
            return bucket_upper_s(i)
    return bucket_upper_s(len(hist) - 1)  # pragma: no cover


_depth = threading.local()


def timed(fn: F) -> F:
    """Count ``fn`` (a method of an object with ``timings: OpTimings``) under its name."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_depth, "n", 0)
        _depth.n = depth + 1
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(self, *args, **kwargs)
        finally:
            _depth.n = depth
            if depth == 0:
                self.timings.record(name, time.perf_counter() - w0, time.thread_time() - c0)

    return wrapper  # type: ignore[return-value]
