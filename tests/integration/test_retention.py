"""Payload retention: consumed payloads dropped after ``buffer.payload_retention_steps``, the
metadata kept, what is still to be trained untouched, and the storage that ``rollcall buffer
stats`` reports."""

from __future__ import annotations

import sqlalchemy as sa

from rollcall.orchestrator.buffer.invariants import check_invariants
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.services.status import buffer_stats
from tests.integration.buffer_helpers import (
    Buffers,
    add_tasks,
    drain_queue,
    make_buffer,
    rows,
    scalar,
)


def _by_step(engine: sa.Engine) -> dict[int, tuple[int, int, int]]:
    """step -> (trajectories, payloads dropped, segments left) of the groups it consumed."""
    out = rows(
        engine,
        """
        SELECT e.consumed_step, count(*),
               count(*) FILTER (WHERE tr.payload_dropped_at IS NOT NULL),
               sum((SELECT count(*) FROM trajectory_segments s WHERE s.episode_id = tr.episode_id
                    AND s.sample_index = tr.sample_index))
        FROM trajectories tr JOIN episodes e ON e.id = tr.episode_id
        WHERE e.consumed_step IS NOT NULL GROUP BY 1 ORDER BY 1
        """,
    )
    return {r[0]: (r[1], r[2], r[3]) for r in out}


def _train(buf: Buffers, worker_id: int, step: int) -> None:
    drain_queue(buf, worker_id, version=step)
    batch = buf.claim_batch(step)
    assert batch.num_trajectories == 2
    buf.commit_step(step)


def test_consumed_payloads_are_dropped_after_the_retention_and_metadata_stays(
    db: Database, engine: sa.Engine
) -> None:
    add_tasks(db, {"name": "a", "group_size": 2, "max_staleness": 100})
    buf = make_buffer(db, batch_groups=1, payload_retention_steps=2)
    buf.seed()
    w = buf.register_worker("r0")
    for step in range(5):
        _train(buf, w.id, step)
        dropped = buf.drop_old_payloads()
        # Steps up to step - 2 are dropped, each once: 2 trajectories of 8 tokens (9 bytes each).
        assert dropped == ((2, 2 * 8 * 9) if step >= 2 else (0, 0))
        assert buf.drop_old_payloads() == (0, 0)
    by_step = _by_step(engine)
    assert by_step == {0: (2, 2, 0), 1: (2, 2, 0), 2: (2, 2, 0), 3: (2, 0, 2), 4: (2, 0, 2)}
    # Metadata stays queryable: rewards, versions, lengths of every trajectory.
    meta = rows(
        engine,
        "SELECT reward, turn_versions, num_tokens FROM trajectories WHERE status = 'consumed'",
    )
    assert len(meta) == 10 and all(m.reward == 1.0 and m.num_tokens == 8 for m in meta)
    # What is not consumed yet keeps its payload and still trains.
    drain_queue(buf, w.id, version=5)
    assert buf.claim_batch(5).num_trajectories == 2
    assert check_invariants(db, 1).ok
    with db.transaction() as tx:
        storage = buffer_stats(tx, None)["storage"]
    assert storage["payloads_dropped"] == 6
    assert storage["segments"] == scalar(engine, "SELECT count(*) FROM trajectory_segments")
    assert storage["payload_bytes"] > 0 and storage["tables"]["trajectory_segments"] > 0
    assert storage["database_bytes_per_step"] > 0


def test_retention_catches_up_in_bounded_passes_and_can_be_off(
    db: Database, engine: sa.Engine
) -> None:
    add_tasks(db, {"name": "a", "group_size": 2, "max_staleness": 100})
    off = make_buffer(db, batch_groups=1, payload_retention_steps=None)
    off.seed()
    w = off.register_worker("r0")
    for step in range(4):
        _train(off, w.id, step)
        assert off.drop_old_payloads() == (0, 0)
    assert (
        scalar(engine, "SELECT count(*) FROM trajectories WHERE payload_dropped_at IS NOT NULL")
        == 0
    )
    # Turned on late (keep 0 steps): one step per pass here, oldest first.
    late = make_buffer(db, batch_groups=1, payload_retention_steps=0)
    assert [late.drop_old_payloads(max_steps=1)[0] for _ in range(5)] == [2, 2, 2, 2, 0]
    assert {s: v[1] for s, v in _by_step(engine).items()} == {0: 2, 1: 2, 2: 2, 3: 2}


def test_retention_drops_the_record_of_calls_with_the_tokens(
    db: Database, engine: sa.Engine
) -> None:
    """Every episode's calls are recorded (``agent_journal``, one row per call): a consumed
    episode's rows go with its payload, so a long job's record does not grow without bound."""
    import dataclasses

    from rollcall.orchestrator.domain import JOURNAL, JOURNAL_STORED
    from tests.integration.buffer_helpers import payload

    add_tasks(db, {"name": "a", "group_size": 2, "max_staleness": 100})
    buf = make_buffer(db, batch_groups=1, payload_retention_steps=0)
    buf.seed()
    w = buf.register_worker("r0")
    calls = [{"k": "chat", "h": "0", "r": {"s": 1, "e": 8, "f": "stop", "v": 0}}] * 3
    for step in range(2):
        c = buf.claim(w.id)
        assert c is not None
        for s in c.samples:
            p = payload(step, seed=s.sample_index)
            state = {"turn": 1, JOURNAL: calls, JOURNAL_STORED: 0}
            p = dataclasses.replace(p, env_state={"state": state})
            buf.commit(c.lease, s.sample_index, p, 1.0)
        assert buf.claim_batch(step).num_trajectories == 2
        buf.commit_step(step)
    assert scalar(engine, "SELECT count(*) FROM agent_journal") == 2 * 2 * 3
    n, nbytes = buf.drop_old_payloads()
    assert n == 4 and nbytes > 4 * 8 * 9  # the tokens, and the record
    assert scalar(engine, "SELECT count(*) FROM agent_journal") == 0
    assert check_invariants(db, 1).ok


def _add_events(engine: sa.Engine, kind: str, n: int, age_s: float, job: int | None = 1) -> None:
    with engine.begin() as c:
        c.execute(
            sa.text(
                "INSERT INTO events (job_id, kind, actor, message, created_at) "
                "SELECT :j, :k, 'test', 'e' || i, now() - make_interval(secs => :age) "
                "FROM generate_series(1, :n) i"
            ),
            {"j": job, "k": kind, "n": n, "age": age_s},
        )


def _events(engine: sa.Engine) -> dict[tuple[int | None, str], int]:
    out = rows(engine, "SELECT job_id, kind, count(*) FROM events GROUP BY 1, 2")
    return {(r[0], r[1]): r[2] for r in out}


def test_old_events_are_dropped_but_not_the_last_hours_nor_the_newest_of_each_kind(
    db: Database, engine: sa.Engine
) -> None:
    """``control_plane.event_retention_s`` / ``event_retention_count``: a job's audit log is
    bounded by age and by count; the last hour's events and the newest of each kind stay."""
    buf = make_buffer(db)
    day = 86_400.0
    before = _events(engine)
    _add_events(engine, "worker.restarting", 500, 8 * day)  # a week and a day ago
    _add_events(engine, "metrics.serving", 2, 8 * day)  # the driver started long ago
    _add_events(engine, "worker.restarting", 300, 2 * 3600)  # two hours ago
    _add_events(engine, "worker.dead", 1_500, 60)  # a storm in the last minute
    _add_events(engine, "worker.restarting", 3, 8 * day, job=None)  # no job's: untouched

    assert buf.drop_old_events(None, None) == 0  # retention off
    # by age (a week): the 500 old restarts and the older metrics.serving go; the newer
    # metrics.serving stays, the newest of its kind (where the driver's /metrics is)
    assert buf.drop_old_events(7 * day, None) == 501
    after = _events(engine)
    assert after[(1, "worker.restarting")] == before.get((1, "worker.restarting"), 0) + 300
    assert after[(1, "metrics.serving")] == before.get((1, "metrics.serving"), 0) + 1
    # by count (the newest 1,000): everything older than the last hour goes but the newest
    # of each kind; the 1,500 of the last minute stay although they are beyond 1,000 too
    dropped = buf.drop_old_events(7 * day, 1_000)
    after = _events(engine)
    assert after[(1, "worker.dead")] == before.get((1, "worker.dead"), 0) + 1_500
    assert after[(1, "worker.restarting")] == before.get((1, "worker.restarting"), 0) + 1
    assert after[(1, "metrics.serving")] == 1
    assert after[(None, "worker.restarting")] == before.get((None, "worker.restarting"), 0) + 3
    assert dropped == 299  # the restarts of two hours ago but their newest
    assert buf.drop_old_events(7 * day, 1_000) == 0  # nothing more to drop
