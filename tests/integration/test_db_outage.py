"""A real database outage (the embedded PostgreSQL stopped, then started again) as the control
plane lives through it: longer than the heartbeat timeout but shorter than the lease, it
declares nobody dead and expires no lease, even when a node's first beat afterwards comes late
(its retry's backoff slept); a node that never beats again is still declared dead once the
grace is over. Once the database is back, the control plane records the outage as one
``database.outage`` event."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from rollcall.orchestrator.buffer.control import ControlPlaneBuffer, DeadWorker
from rollcall.orchestrator.buffer.rollout import RolloutBuffer
from rollcall.orchestrator.config import BufferConfig
from rollcall.orchestrator.db import retry
from rollcall.orchestrator.db.embedded import EmbeddedPostgres
from rollcall.orchestrator.db.engine import Database, open_database
from tests.integration.buffer_helpers import add_tasks, rows
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(300)

HEARTBEAT_TIMEOUT_S = 2.0  # control_plane.heartbeat_timeout_s
LEASE_S = 6.0  # buffer.lease_s
OUTAGE_S = HEARTBEAT_TIMEOUT_S + 1.5  # the server is down this long (plus its start)
LATE_S = 4.0  # a node's first beat after the outage comes this late (< the retries' cap)


@pytest.fixture
def server(pg: Any) -> Iterator[EmbeddedPostgres]:
    s = EmbeddedPostgres(pg.home)
    yield s
    s.ensure_running()  # never leave the session's server stopped


@pytest.fixture
def prompt_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control plane's calls retry every 50 ms, so that it sees the end of the outage at
    once (with the real backoff it may see it up to 5 s late, which only lengthens the
    grace); a node's late beat is made explicitly late below."""
    monkeypatch.setattr(retry, "backoff_s", lambda attempt, **_: 0.05)


class ControlPlane:
    """The driver's sweeps, on a thread of their own, as its scheduler runs them."""

    def __init__(self, buf: ControlPlaneBuffer) -> None:
        self.buf = buf
        self.dead: list[DeadWorker] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.dead += self.buf.sweep_dead_workers(HEARTBEAT_TIMEOUT_S, 600.0)
                self.buf.sweep_expired_leases()
            except Exception as e:  # a call past its retry window: the next run retries
                self.errors.append(e)
            self._stop.wait(0.2)

    def __enter__(self) -> ControlPlane:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def test_outage_longer_than_the_heartbeat_timeout_declares_nobody_dead_nor_expires_a_lease(
    db: Database, db_url: str, engine: sa.Engine, server: EmbeddedPostgres, prompt_retries: None
) -> None:
    add_tasks(db, {"name": "t", "max_inflight": 8})
    config = BufferConfig(lease_s=LEASE_S, retry_window_s=5.0)
    control = ControlPlaneBuffer(db, 1, config)
    control.seed()
    node_db = open_database(db_url)  # the nodes' own connections, as in their processes
    try:
        node = RolloutBuffer(node_db, 1, config)
        late, gone = node.register_worker("late"), node.register_worker("gone")
        late_claim, gone_claim = node.claim(late.id), node.claim(gone.id)
        assert late_claim is not None and gone_claim is not None
        with ControlPlane(control) as cp:
            wait_for("a sweep", lambda: control._last_dead_sweep is not None)
            for w in (late, gone):  # their last beats (and lease renewals) before the outage
                assert node.beat(w.id)[0]
            server.stop()
            time.sleep(OUTAGE_S)
            server.ensure_running()
            # "late" comes back LATE_S after the database did, as a retry that slept would;
            # "gone" never does
            time.sleep(LATE_S)
            alive, held = node.beat(late.id)
            assert alive, f"declared dead after the outage: {[d.reason for d in cp.dead]}"
            assert held == [(late_claim.lease.episode_id, late_claim.lease.epoch)]
            # the grace is bounded: a node that does not beat again is declared dead (while
            # "late" beats as usual)
            deadline = time.monotonic() + 90
            while not cp.dead and time.monotonic() < deadline:
                assert node.beat(late.id)[0]
                time.sleep(0.3)
            assert cp.dead, "the silent node was never declared dead"
        assert [(d.name, d.swept.requeued) for d in cp.dead] == [("gone", 1)]
        assert cp.dead[0].reason.startswith("no heartbeat for ")
    finally:
        node_db.dispose()
    engine.dispose()
    leased = rows(
        engine, "SELECT id, lease_owner, lease_epoch FROM episodes WHERE status = 'leased'"
    )
    assert leased == [(late_claim.lease.episode_id, late.id, late_claim.lease.epoch)]
    dead = rows(engine, "SELECT name FROM workers WHERE status = 'dead'")
    assert dead == [("gone",)]


def test_a_database_restart_is_recorded_as_one_outage_event(
    db: Database, db_url: str, engine: sa.Engine, server: EmbeddedPostgres
) -> None:
    add_tasks(db, {"name": "t", "max_inflight": 8})
    control = ControlPlaneBuffer(db, 1, BufferConfig(retry_window_s=20.0))
    control.record_outages = True  # the driver's control plane records them
    node_db = open_database(db_url)
    try:
        # a node's: logs, records nothing
        node = RolloutBuffer(node_db, 1, BufferConfig(retry_window_s=20.0))
        w = node.register_worker("r0")
        stop = threading.Event()

        def beats() -> None:
            while not stop.is_set():
                node.beat(w.id)
                stop.wait(0.1)

        beating = threading.Thread(target=beats, daemon=True)
        with ControlPlane(control):
            beating.start()
            wait_for("a sweep", lambda: control._last_dead_sweep is not None)
            t0 = time.monotonic()
            server.stop()
            time.sleep(2.0)
            t1 = time.monotonic()
            server.ensure_running()
            # the control plane's calls go through again, and report the outage
            wait_for(
                "the outage event",
                lambda: (
                    rows(engine, "SELECT count(*) FROM events WHERE kind = 'database.outage'")
                    != [(0,)]
                ),
                timeout_s=60,
            )
            time.sleep(1.0)  # more calls succeed, and stale connections fail once: no new event
            t2 = time.monotonic()
        stop.set()
        beating.join(timeout=60)
    finally:
        node_db.dispose()
    engine.dispose()
    events = rows(
        engine, "SELECT actor, message, payload FROM events WHERE kind = 'database.outage'"
    )
    assert len(events) == 1, events
    actor, message, payload = events[0]
    assert actor == "control-plane"
    # it lasted at least while the server was down, at most the whole test
    assert t1 - t0 - 1.0 <= payload["duration_s"] <= t2 - t0, (payload, t1 - t0, t2 - t0)
    assert payload["began_at"] < payload["ended_at"]
    # the control plane's calls that met the outage: whichever sweep was due (the one that
    # met it first retries until the server is back, the other may never fail)
    sweeps = {"ControlPlaneBuffer.sweep_dead_workers", "ControlPlaneBuffer.sweep_expired_leases"}
    assert sweeps & set(payload["operations"]), payload
    assert "RolloutBuffer.beat" not in payload["operations"]  # the node's own, not this process's
    assert message.startswith("database unavailable for ")


def test_a_sweep_after_a_stall_says_so_in_the_log(
    db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """A gap between two dead-worker sweeps longer than half the heartbeat timeout (the driver
    or the database stalled) postpones every death declaration: the driver.log says so."""
    control = ControlPlaneBuffer(db, 1)
    control.sweep_dead_workers(HEARTBEAT_TIMEOUT_S, 600.0)
    time.sleep(HEARTBEAT_TIMEOUT_S / 2 + 0.5)
    with caplog.at_level("WARNING", logger="rollcall.orchestrator.buffer.control"):
        control.sweep_dead_workers(HEARTBEAT_TIMEOUT_S, 600.0)
        control.sweep_dead_workers(HEARTBEAT_TIMEOUT_S, 600.0)  # no gap: no line
    lines = [r.getMessage() for r in caplog.records if "dead-worker sweep" in r.getMessage()]
    assert len(lines) == 1 and "since the last one" in lines[0], lines
