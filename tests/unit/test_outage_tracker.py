"""The retry layer's outage tracker: one outage is reported once, however many calls (and
threads) rode it out; the failures of connections that broke with the old server, right after
it is back, belong to the outage that closed."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from sqlalchemy import exc as sa_exc

from rollcall.orchestrator.db import retry
from rollcall.orchestrator.db.retry import SETTLE_S, Outage, OutageTracker, retry_transient


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_one_outage_many_failures_one_report() -> None:
    clock = Clock()
    tracker = OutageTracker(clock)
    err = psycopg.OperationalError("connection refused")
    for op in ("Buffer.beat", "Buffer.seed", "Buffer.beat"):
        tracker.failed(op, err)
        clock.t += 1.0
    assert tracker.pending and tracker.failures == 3
    (outage,) = tracker.take()
    assert outage.duration_s == 3.0 and outage.failures == 3
    assert outage.operations == {"Buffer.beat": 2, "Buffer.seed": 1}
    assert outage.error == "OperationalError" and outage.began_at <= outage.ended_at
    assert outage.describe().startswith("database unavailable for 3.0 s, back now")
    assert tracker.take() == [] and not tracker.pending  # reported once

    # a stale connection fails right after: the same outage's tail, nothing new to report
    clock.t += SETTLE_S / 2
    tracker.failed("Buffer.claim", err)
    assert tracker.take() == [] and tracker.failures == 4

    # failures that go on past the settling time are a new outage, from the first of them
    clock.t += SETTLE_S / 4
    tracker.failed("Buffer.claim", err)
    clock.t += SETTLE_S
    tracker.failed("Buffer.beat", err)
    clock.t += 1.0
    (second,) = tracker.take()
    assert second.duration_s == pytest.approx(SETTLE_S + 1.0)
    assert second.operations == {"Buffer.claim": 1, "Buffer.beat": 1}

    tracker.put_back(second)  # its report failed: handed out after the next success
    assert tracker.take() == [second]


class Flaky:
    """An object with ``retry_transient`` methods, as the Buffer is."""

    retry_window_s = 5.0

    def __init__(self, failures: int) -> None:
        self.outages = OutageTracker()
        self.failures = failures
        self.reported: list[Outage] = []

    def _outage_ended(self, outage: Outage) -> None:
        self.reported.append(outage)

    def error(self) -> Exception:
        """What a failed call raises."""
        return psycopg.OperationalError("the database system is starting up")

    @retry_transient
    def call(self) -> str:
        if self.failures:
            self.failures -= 1
            raise self.error()
        return "ok"


def test_retried_calls_report_the_outage_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "backoff_s", lambda attempt, **_: 0.0)
    flaky = Flaky(failures=4)
    assert [flaky.call() for _ in range(3)] == ["ok"] * 3
    assert len(flaky.reported) == 1
    assert flaky.reported[0].operations == {"Flaky.call": 4}


def test_a_failed_report_is_made_again_after_the_next_success(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(retry, "backoff_s", lambda attempt, **_: 0.0)
    flaky = Flaky(failures=2)
    attempts: list[Any] = []

    def report(outage: Outage) -> None:
        attempts.append(outage)
        if len(attempts) == 1:
            raise psycopg.OperationalError("down again")

    monkeypatch.setattr(flaky, "_outage_ended", report)
    flaky.call()
    flaky.call()
    flaky.call()
    assert len(attempts) == 2 and attempts[0] is attempts[1]


class Crowded(Flaky):
    """Its calls find every connection of a bounded pool in use a few times (SQLAlchemy's
    ``TimeoutError``, raised by the pool after its ``pool_timeout``), then get one."""

    retry_window_s = 0.0  # an outage would not be retried at all

    def error(self) -> Exception:
        return sa_exc.TimeoutError("QueuePool limit of size 8 overflow 0 reached")


def test_waiting_for_a_pooled_connection_is_no_outage_and_not_bounded_by_the_window() -> None:
    crowded = Crowded(failures=3)
    assert crowded.call() == "ok"
    assert crowded.reported == [] and crowded.outages.failures == 0
