"""The buffer's operation timings (``orchestrator/buffer/timings.py``): counts, histogram
buckets, percentiles, interval differences, and nested operations counted once."""

from __future__ import annotations

import pytest

from rollcall.orchestrator.buffer import timings
from rollcall.orchestrator.buffer.timings import (
    OpTimings,
    bucket_of,
    bucket_upper_s,
    percentile_s,
    timed,
)


def test_buckets_are_log_spaced_twenty_per_decade() -> None:
    assert bucket_of(0.0) == 0 and bucket_of(1e-5) == 0
    # 1e-4 s is one decade above the lowest edge: bucket 1 + 20 = 21, whose upper edge is
    # 1e-5 x 10^(21/20) = 1.122e-4 (a percentile reads at most 12% high)
    assert bucket_of(1e-4) == 21
    assert bucket_upper_s(21) == pytest.approx(1.122e-4, rel=1e-3)
    assert bucket_of(1e9) == timings.BUCKETS  # overflow bucket


def test_percentiles_from_the_histogram() -> None:
    t = OpTimings()
    for _ in range(99):
        t.record("claim", 0.001, 0.0)
    t.record("claim", 0.1, 0.0)
    hist = t.snapshot()["claim"]["hist"]
    # rank ceil(0.5 x 100) = 50 and ceil(0.99 x 100) = 99 fall on the 1 ms bucket; 100 on 0.1 s
    assert percentile_s(hist, 50) == pytest.approx(bucket_upper_s(bucket_of(0.001)))
    assert percentile_s(hist, 99) == pytest.approx(bucket_upper_s(bucket_of(0.001)))
    assert percentile_s(hist, 100) == pytest.approx(bucket_upper_s(bucket_of(0.1)))
    assert percentile_s([0] * 5, 50) is None


def test_snapshots_subtract_into_an_interval_and_add_across_processes() -> None:
    t = OpTimings()
    t.record("commit", 0.002, 0.001)
    before = t.snapshot()
    t.record("commit", 0.004, 0.002)
    t.record("claim", 0.001, 0.0005)
    d = timings.diff(t.snapshot(), before)
    assert d["commit"]["calls"] == 1 and d["commit"]["wall_s"] == pytest.approx(0.004)
    assert d["claim"]["calls"] == 1
    m = timings.merge([d, d])
    assert m["commit"]["calls"] == 2 and m["claim"]["cpu_s"] == pytest.approx(0.001)
    assert sum(m["commit"]["hist"]) == 2


def test_nested_operations_count_once_in_the_outer_one() -> None:
    class Service:
        def __init__(self) -> None:
            self.timings = OpTimings()

        @timed
        def outer(self) -> int:
            return self.inner() + 1

        @timed
        def inner(self) -> int:
            return 1

    s = Service()
    assert s.outer() == 2 and s.inner() == 1
    snap = s.timings.snapshot()
    assert snap["outer"]["calls"] == 1 and snap["inner"]["calls"] == 1  # the direct call only


def test_a_failing_operation_is_counted_too() -> None:
    class Service:
        def __init__(self) -> None:
            self.timings = OpTimings()

        @timed
        def boom(self) -> None:
            raise RuntimeError("x")

    s = Service()
    with pytest.raises(RuntimeError):
        s.boom()
    assert s.timings.snapshot()["boom"]["calls"] == 1
