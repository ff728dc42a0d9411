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


def pass_at_k(outcomes: Sequence[bool], k: int) -> float:
    """The unbiased estimate of pass@k for one prompt from its ``n`` samples, ``c`` of them
    passing (Chen et al. 2021): the chance that k samples drawn without replacement from the n
    hold at least one pass, 1 - C(n - c, k) / C(n, k), computed as a product."""
    n, c = len(outcomes), sum(1 for o in outcomes if o)
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= the {n} samples of a prompt")
    if n - c < k:
        return 1.0
    fail = 1.0
    for i in range(n - c + 1, n + 1):
        fail *= 1.0 - k / i
    return 1.0 - fail


def pass_rates(
    samples: Sequence[Sequence[float]], ks: Sequence[int], threshold: float
) -> dict[str, float]:
    """pass@k for each k (a sample passes when its reward is at least ``threshold``) and
    mean@n, the mean reward of all samples, averaged over the prompts."""
    if not samples:
        return {}
    out = {
        f"pass@{k}": sum(pass_at_k([r >= threshold for r in rs], k) for rs in samples)
        / len(samples)
        for k in ks
    }
    n = len(samples[0])
    out[f"mean@{n}"] = sum(sum(rs) / len(rs) for rs in samples) / len(samples)
    return out


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


def pass_changes(
    evals: Sequence[Mapping[str, Any]],
) -> list[tuple[str, list[tuple[str, float, float]]]]:
    """Per task, pass@k and mean@n at the first and the last evaluation that reported them."""
    points = [r for r in evals if r.get("pass")]
    out = []
    for task in sorted({t for r in points for t in r["pass"]}):
        first = next(r["pass"][task] for r in points if task in r["pass"])
        last = next(r["pass"][task] for r in reversed(points) if task in r["pass"])
        out.append((task, [(k, float(first[k]), float(last[k])) for k in last if k in first]))
    return out
