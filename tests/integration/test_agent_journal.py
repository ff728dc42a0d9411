"""An agent's record of calls is stored append-only: each checkpoint writes only the calls it
added (``agent_journal`` rows, migration 0008), and a resume reads the whole journal back in
order, exactly as it was written (``orchestrator/db/repos/trajectories.py``)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from rollcall.orchestrator.buffer.types import ClaimedEpisode
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.db.models import Trajectory
from rollcall.orchestrator.domain import JOURNAL, JOURNAL_STORED, TrajectoryPayload
from tests.integration.buffer_helpers import add_tasks, make_buffer, payload, rows, scalar


def _entry(i: int) -> dict[str, Any]:
    if i % 2:
        return {"k": "tool", "h": f"h{i}", "r": {"c": f"result {i} " + "x" * 100 + "\x00"}}
    return {"k": "chat", "h": f"h{i}", "r": {"s": i, "e": i + 1, "f": "stop", "v": 0}}


def _payload(journal: list[dict[str, Any]], stored: int | None, seed: int = 0) -> TrajectoryPayload:
    base = payload(0, n_tokens=8 + len(journal), seed=seed)
    state: dict[str, Any] = {JOURNAL: journal, "other": {"n": len(journal)}}
    if stored is not None:
        state[JOURNAL_STORED] = stored
    return TrajectoryPayload.build(
        base.token_ids,
        base.loss_mask,
        base.behaviour_logprobs,
        turn_offsets=base.turn_offsets,
        turn_versions=base.turn_versions,
        prompt_tokens=1,
        env_state={"state": state, "answer": None, "stop_reason": ""},
    )


def _claim(db: Database, group_size: int = 1) -> tuple[Any, ClaimedEpisode]:
    add_tasks(db, {"name": "a", "group_size": group_size})
    buf = make_buffer(db, batch_groups=1)
    buf.seed()
    c = buf.claim(buf.register_worker("r0").id)
    assert c is not None
    return buf, c


def _resumed(db: Database, buf: Any, c: ClaimedEpisode) -> dict[str, Any]:
    """The sample's state as the next claimer receives it."""
    buf.release(c.lease, "engine failed", counted=False)
    other = make_buffer(db, batch_groups=1)
    c2 = other.claim(other.register_worker("r1").id)
    assert c2 is not None and c2.samples[0].checkpoint is not None
    return dict(c2.samples[0].checkpoint.env_state["state"])


def _journal_rows(engine: sa.Engine) -> list[Any]:
    return rows(engine, "SELECT seq, xmin::text AS xmin, entry FROM agent_journal ORDER BY seq")


def test_each_checkpoint_stores_only_its_calls_and_a_resume_reads_them_all(
    db: Database, engine: sa.Engine
) -> None:
    buf, c = _claim(db)
    entries = [_entry(i) for i in range(6)]
    written: dict[int, str] = {}
    for k in range(1, len(entries) + 1):
        buf.checkpoint(c.lease, 0, _payload(entries[:k], stored=k - 1, seed=k))
        stored = _journal_rows(db.engine)
        assert [r.seq for r in stored] == list(range(k))
        # the calls stored before are untouched: the same row versions
        assert all(written.get(r.seq, r.xmin) == r.xmin for r in stored)
        written[k - 1] = stored[-1].xmin
        assert scalar(engine, "SELECT journal_calls FROM trajectories") == k
    # the metadata row holds the state without the journal (or the writer's mark)
    state = scalar(db.engine, "SELECT env_state->'state' FROM trajectories")
    assert state == {"other": {"n": 6}}
    with db.transaction() as tx:  # what a drill counts as the calls recorded at a fault
        (held,) = tx.invariants.samples_of_worker(c.lease.worker_id)
    assert held["agent_calls"] == 6
    assert _resumed(db, buf, c) == {JOURNAL: entries, "other": {"n": 6}}


def test_a_mark_counting_calls_that_are_not_stored_writes_the_whole_journal(
    db: Database, engine: sa.Engine
) -> None:
    buf, c = _claim(db)
    entries = [_entry(i) for i in range(4)]
    buf.checkpoint(c.lease, 0, _payload(entries[:1], stored=0))
    # the writer believes three are stored, but one is: written again from the first
    buf.checkpoint(c.lease, 0, _payload(entries, stored=3))
    assert [r.entry for r in _journal_rows(db.engine)] == entries
    assert _resumed(db, buf, c)[JOURNAL] == entries


def test_a_run_that_started_over_replaces_the_journal(db: Database, engine: sa.Engine) -> None:
    buf, c = _claim(db)
    entries = [_entry(i) for i in range(5)]
    for k in range(1, 6):
        buf.checkpoint(c.lease, 0, _payload(entries[:k], stored=k - 1))
    # a divergence: the sample runs again from scratch with an empty record
    again = [{"k": "step", "h": "new", "r": {"v": 1}}]
    buf.checkpoint(c.lease, 0, _payload(again, stored=0))
    assert scalar(engine, "SELECT journal_calls FROM trajectories") == 1
    assert _resumed(db, buf, c)[JOURNAL] == again


def test_a_commit_of_the_whole_group_checks_each_mark(db: Database, engine: sa.Engine) -> None:
    _, c = _claim(db, group_size=2)
    entries = [_entry(i) for i in range(3)]
    with db.transaction() as tx:
        out = tx.trajectories.write_samples(
            episode_id=c.lease.episode_id,
            epoch=c.lease.epoch,
            samples=[
                (0, _payload(entries, stored=0), 1.0, None, 0),
                (1, _payload(entries[:2], stored=2), 0.5, None, 0),  # nothing stored yet
            ],
        )
    assert out == [("written", False), ("written", True)]
    got = rows(
        engine,
        "SELECT sample_index, count(*) AS n FROM agent_journal GROUP BY 1 ORDER BY 1",
    )
    assert [(r.sample_index, r.n) for r in got] == [(0, 3), (1, 2)]
    with db.transaction() as tx:  # as the trainer's batch claim reads them
        found = list(
            tx.session.execute(sa.select(Trajectory).order_by(Trajectory.sample_index)).scalars()
        )
        loaded = tx.trajectories.payloads(found)
    assert [p.env_state["state"][JOURNAL] for p in loaded] == [entries, entries[:2]]


def test_a_state_without_the_mark_is_stored_as_it_is(db: Database, engine: sa.Engine) -> None:
    """A plugin's state, or a journal checkpointed before migration 0008: inline, as before."""
    buf, c = _claim(db)
    entries = [_entry(i) for i in range(3)]
    buf.checkpoint(c.lease, 0, _payload(entries, stored=None))
    assert scalar(engine, "SELECT journal_calls FROM trajectories") is None
    assert scalar(engine, "SELECT count(*) FROM agent_journal") == 0
    state = scalar(db.engine, "SELECT env_state->'state' FROM trajectories")
    assert state == {JOURNAL: entries, "other": {"n": 3}}
    assert _resumed(db, buf, c) == {JOURNAL: entries, "other": {"n": 3}}


def test_a_downgrade_puts_journals_back_into_the_state(db: Database) -> None:
    from rollcall.orchestrator.db import migrate

    buf, c = _claim(db)
    entries = [_entry(i) for i in range(3)]
    for k in range(1, 4):
        buf.checkpoint(c.lease, 0, _payload(entries[:k], stored=k - 1))
    db.dispose()
    engine = sa.create_engine(db.engine.url, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        migrate.downgrade(conn, "0007")
        conn.commit()
        state = conn.execute(sa.text("SELECT env_state->'state' FROM trajectories")).scalar_one()
        migrate.upgrade(conn)
        conn.commit()
        assert migrate.drift(conn) == []
    engine.dispose()
    # escaped as stored (this engine reads JSON without rollcall's decoding)
    assert state["other"] == {"n": 3} and [e["h"] for e in state[JOURNAL]] == ["h0", "h1", "h2"]
