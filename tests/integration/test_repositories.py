"""Repositories and the partition lifecycle on a real PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.domain import TaskStatus
from rollcall.orchestrator.errors import ConflictError


def _insert_trajectory(engine: sa.Engine, task_id: int, sample: int = 0) -> None:
    with engine.begin() as conn:
        ep = conn.scalar(
            sa.text(
                "INSERT INTO episodes (job_id, task_id, prompt_index, prompt, group_size) "
                "VALUES (1, :t, 0, '{}'::jsonb, 4) RETURNING id"
            ),
            {"t": task_id},
        )
        conn.execute(
            sa.text(
                "INSERT INTO trajectories (task_id, episode_id, sample_index, lease_epoch, "
                "num_tokens) VALUES (:t, :e, :s, 1, 1)"
            ),
            {"t": task_id, "e": ep, "s": sample},
        )


def _partitions(engine: sa.Engine) -> dict[str, bool]:
    """partition name -> attached to trajectories?"""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT c.relname, c.relispartition FROM pg_class c "
                "WHERE c.relkind = 'r' AND c.relname ~ '^trajectories_t[0-9]+$'"
            )
        ).all()
    return {name: attached for name, attached in rows}


def _create(db: Database, name: str = "a", **kw: Any) -> Any:
    with db.transaction() as tx:
        return tx.tasks.create(
            job_id=1,
            name=name,
            plugin="echo",
            spec={"group_size": 2},
            weight=kw.get("weight", 1.0),
            max_inflight=kw.get("max_inflight", 2),
            max_staleness=kw.get("max_staleness", 1),
        )


def test_task_partition_lifecycle(db: Database, engine: sa.Engine) -> None:
    a = _create(db, "a")
    b = _create(db, "b")
    assert _partitions(engine) == {a.partition: True, b.partition: True}

    _insert_trajectory(engine, a.id)
    _insert_trajectory(engine, b.id)
    with engine.connect() as conn:
        assert conn.scalar(sa.text(f"SELECT count(*) FROM {a.partition}")) == 1
        assert conn.scalar(sa.text("SELECT count(*) FROM trajectories")) == 2

    with db.transaction() as tx:
        assert tx.tasks.counts(a.id).trajectories == {"in_progress": 1}
        assert tx.tasks.counts(a.id).episodes == {"queued": 1}
        retired = tx.tasks.retire(a.id)
    assert retired.status == TaskStatus.RETIRED
    assert retired.retired_at is not None
    assert _partitions(engine) == {a.partition: False, b.partition: True}
    with engine.connect() as conn:
        # The rows stay, in the detached table; the buffer no longer sees them.
        assert conn.scalar(sa.text(f"SELECT count(*) FROM {a.partition}")) == 1
        assert conn.scalar(sa.text("SELECT count(*) FROM trajectories")) == 1
    with db.transaction() as tx:
        assert tx.tasks.counts(a.id).partition_attached is False


def test_trajectory_without_partition_is_rejected(db: Database, engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO tasks (job_id, name, plugin, weight, max_inflight, max_staleness) VALUES (1, 'np', 'echo', 1, 1, 0)"
            )
        )
    with pytest.raises(sa.exc.IntegrityError, match="no partition"):
        _insert_trajectory(engine, 1)


def test_duplicate_live_name_conflicts_and_leaves_nothing(db: Database, engine: sa.Engine) -> None:
    _create(db, "a")
    with pytest.raises(ConflictError, match="already exists"), db.transaction() as tx:
        tx.tasks.create(
            job_id=1, name="a", plugin="echo", spec={}, weight=1, max_inflight=1, max_staleness=0
        )
    assert len(_partitions(engine)) == 1
    with db.transaction() as tx:
        assert [t.name for t in tx.tasks.list(1)] == ["a"]


def test_retired_name_can_be_reused(db: Database) -> None:
    a = _create(db, "a")
    with db.transaction() as tx:
        tx.tasks.retire(a.id)
    a2 = _create(db, "a")
    assert a2.id != a.id
    with db.transaction() as tx:
        assert tx.tasks.get_by_name(1, "a") == a2  # the live one wins
        assert len(tx.tasks.list(1)) == 2
        assert len(tx.tasks.list(1, include_retired=False)) == 1


def test_quota_constraints_enforced_by_database(engine: sa.Engine) -> None:
    for col, bad in (("weight", 0), ("max_inflight", 0), ("max_staleness", -1)):
        values = {"weight": 1, "max_inflight": 1, "max_staleness": 0, col: bad}
        with (
            pytest.raises(sa.exc.IntegrityError, match="violates check constraint"),
            engine.begin() as conn,
        ):
            conn.execute(
                sa.text(
                    "INSERT INTO tasks (job_id, name, plugin, weight, max_inflight, max_staleness) VALUES (1, 'x', 'echo', :weight, :max_inflight, :max_staleness)"
                ),
                values,
            )


def test_status_enum_enforced_by_database(engine: sa.Engine) -> None:
    with (
        pytest.raises(sa.exc.DataError, match="invalid input value for enum task_status"),
        engine.begin() as conn,
    ):
        conn.execute(
            sa.text(
                "INSERT INTO tasks (job_id, name, plugin, weight, max_inflight, max_staleness, status) VALUES (1, 'x', 'echo', 1, 1, 0, 'sleeping')"
            )
        )


def test_quota_and_status_updates(db: Database) -> None:
    a = _create(db, "a")
    with db.transaction() as tx:
        t = tx.tasks.set_quota(a.id, weight=3.5)
        assert (t.weight, t.max_inflight, t.max_staleness) == (3.5, 2, 1)
        t = tx.tasks.set_quota(a.id, max_inflight=9, max_staleness=0)
        assert (t.weight, t.max_inflight, t.max_staleness) == (3.5, 9, 0)
        assert tx.tasks.set_status(a.id, TaskStatus.PAUSED).status == TaskStatus.PAUSED
        assert t.updated_at <= tx.tasks.get(a.id).updated_at  # type: ignore[union-attr]


def test_repositories_do_not_commit(db: Database) -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom), db.transaction() as tx:
        tx.jobs.create("j2")
        tx.events.add("x.y", "test", "m")
        _ = tx.tasks.create(
            job_id=1, name="z", plugin="echo", spec={}, weight=1, max_inflight=1, max_staleness=0
        )
        raise Boom
    with db.transaction() as tx:
        assert tx.jobs.get_by_name("j2") is None
        assert tx.tasks.list(1) == []
        assert tx.events.list() == []


def test_events_filters(db: Database) -> None:
    with db.transaction() as tx:
        tx.events.add("task.paused", "op", "m1", job_id=1)
        tx.events.add("task.resumed", "op", "m2", job_id=1)
        tx.events.add("job.created", "op", "m3", job_id=1)
    with db.transaction() as tx:
        assert [e.message for e in tx.events.list()] == ["m1", "m2", "m3"]
        assert [e.message for e in tx.events.list(kind="task.")] == ["m1", "m2"]
        assert [e.message for e in tx.events.list(kind="job.created")] == ["m3"]
        assert [e.message for e in tx.events.list(limit=2)] == ["m2", "m3"]


def test_timestamps_come_from_database_clock(db: Database, engine: sa.Engine) -> None:
    a = _create(db, "a")
    with engine.connect() as conn:
        db_now = conn.scalar(sa.text("SELECT now()"))
    assert abs((db_now - a.created_at).total_seconds()) < 60
    assert a.created_at.tzinfo is not None
