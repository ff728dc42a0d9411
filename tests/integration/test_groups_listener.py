"""The trainer loop's wake-up: a completed group notifies the job's channel (LISTEN/NOTIFY)."""

from __future__ import annotations

import sqlalchemy as sa

from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.db.notify import GroupsListener
from tests.integration.buffer_helpers import (
    Buffers,
    add_tasks,
    finish,
    make_buffer,
    payload,
    scalar,
)


def _seeded(
    db: Database, *, group_size: int, batch_groups: int, **task: int
) -> tuple[Buffers, int]:
    """One task "a" of the default job (id 1), seeded; the buffer and a rollout worker's id."""
    add_tasks(db, {"name": "a", "group_size": group_size, **task})
    buf = make_buffer(db, batch_groups=batch_groups)
    buf.seed()
    return buf, buf.register_worker("r0").id


def _complete_one(buf: Buffers, worker_id: int) -> None:
    c = buf.claim(worker_id)
    assert c is not None
    finish(buf, c, version=0)


def test_a_completed_group_wakes_the_jobs_listener_and_no_other(
    db: Database, engine: sa.Engine
) -> None:
    buf, w = _seeded(db, group_size=2, batch_groups=2)
    ours, other = GroupsListener(db.url, 1), GroupsListener(db.url, 2)
    try:
        assert not ours.wait(0.05) and not other.wait(0.05)  # connected, listening, nothing yet
        # Per-sample commits (the hot path, autocommit): only the group's last one notifies.
        c = buf.claim(w)
        assert c is not None
        buf.commit(c.lease, 0, payload(0, seed=0), 1.0)
        assert not ours.wait(0.2)
        buf.commit(c.lease, 1, payload(0, seed=1), 1.0)
        assert ours.wait(10) and ours.wakeups == 1
        assert not other.wait(0.2) and other.wakeups == 0  # another job's channel stays quiet
    finally:
        ours.close()
        other.close()


def test_the_listener_reconnects_after_its_connection_is_killed(
    db: Database, engine: sa.Engine
) -> None:
    buf, w = _seeded(db, group_size=1, batch_groups=2)
    listener = GroupsListener(db.url, 1, application_name="rollcall-listen-test")
    try:
        assert not listener.wait(0.05)
        killed = scalar(
            engine,
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = 'rollcall-listen-test'",
        )
        assert killed == 1
        assert not listener.wait(0.2)  # the broken connection: closed, a timeout's sleep
        assert not listener.wait(0.05)  # reconnected and listening again
        _complete_one(buf, w)
        assert listener.wait(10) and listener.wakeups == 1
    finally:
        listener.close()


def test_a_wait_for_a_batch_ends_when_as_many_groups_completed_as_it_lacked(
    db: Database, engine: sa.Engine
) -> None:
    buf, w = _seeded(db, group_size=1, batch_groups=3, max_staleness=4)
    listener = GroupsListener(db.url, 1)
    try:
        assert not listener.wait(0.05)  # listening
        _complete_one(buf, w)
        empty = buf.claim_batch(0, min_groups=3)
        assert not empty.groups and empty.shortfall == 2
        assert listener.wait(10)  # the group that landed before the claim (a stale hint)
        _complete_one(buf, w)
        assert not listener.wait(0.3, count=empty.shortfall)  # one of the two: not yet
        _complete_one(buf, w)
        _complete_one(buf, w)
        assert listener.wait(10, count=2)
        batch = buf.claim_batch(0, min_groups=3)
        assert len(batch.groups) == 3 and batch.shortfall == 0
    finally:
        listener.close()
