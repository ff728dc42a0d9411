"""Held-out rewards with their 95% intervals: the learning curve's band and the final summary.

An evaluation scores the same held-out prompts with the same per-prompt sampling seeds every
time (``rollcall.workers.evaluation``), so the gain of a run is a paired difference: prompt ``i`` at
the end against prompt ``i`` at the start. Intervals are normal approximations (mean +- 1.96
standard errors), fair for the 32+ episodes per task an evaluation plays.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Z95 = 1.959964


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def mean_interval(values: Sequence[float]) -> Interval:
    """The mean of ``values`` and its 95% interval (a single value: no width)."""
    n = len(values)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    mean = sum(values) / n
    if n == 1:
        return Interval(mean, mean, mean, 1)
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    half = Z95 * math.sqrt(var / n)
    return Interval(mean, mean - half, mean + half, n)


def paired_gain(start: Sequence[float], end: Sequence[float]) -> Interval:
    """The mean gain from ``start`` to ``end`` over the same prompts, with its 95% interval."""
    if len(start) != len(end):
        raise ValueError(f"paired rewards differ in length: {len(start)} and {len(end)}")
    return mean_interval([b - a for a, b in zip(start, end, strict=True)])


@dataclass(frozen=True)
class TaskGain:
    task: str
    start: float
    end: float
    gain: Interval | None  # None: the records hold means only (written before intervals)
    start_step: int
    end_step: int


def gains(evals: Sequence[Mapping[str, Any]]) -> list[TaskGain]:
    """Per task, the first and the last evaluation of ``eval`` records (``metrics.jsonl``) and
    the paired gain between them."""
    out: list[TaskGain] = []
    for task in sorted({t for r in evals for t in r["reward"]}):
        points = [r for r in evals if task in r["reward"]]
        first, last = points[0], points[-1]
        a = first.get("rewards", {}).get(task)
        b = last.get("rewards", {}).get(task)
        gain = paired_gain(a, b) if a and b and len(a) == len(b) else None
        out.append(
            TaskGain(
                task,
                float(first["reward"][task]),
                float(last["reward"][task]),
                gain,
                int(first["step"]),
                int(last["step"]),
            )
        )
    return out
