"""The write rules of a sample, each tested once, directly: ``rollcall_write_sample``
(migrations 0002, 0005) through ``TrajectoryRepository.write_sample`` / ``write_samples``, the one
implementation the buffer's checkpoints and commits use."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from rollcall.orchestrator.buffer.groupcommit import Pending
from rollcall.orchestrator.buffer.rollout import RolloutBuffer
from rollcall.orchestrator.buffer.types import ClaimedEpisode
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.domain import TrajectoryPayload
from rollcall.orchestrator.errors import StaleLeaseError
from tests.integration.buffer_helpers import add_tasks, make_buffer, payload, rows, scalar


def _claim(db: Database, group_size: int) -> ClaimedEpisode:
    add_tasks(db, {"name": "a", "group_size": group_size})
    buf = make_buffer(db, batch_groups=1)
    buf.seed()
    c = buf.claim(buf.register_worker("r0").id)
    assert c is not None
    return c


def _write(
    db: Database,
    c: ClaimedEpisode,
    sample: int,
    p: TrajectoryPayload,
    reward: float | None,
    *,
    epoch: int | None = None,
    start: int = 0,
) -> tuple[str, bool]:
    with db.autocommit() as tx:
        return tx.trajectories.write_sample(
            episode_id=c.lease.episode_id,
            epoch=c.lease.epoch if epoch is None else epoch,
            sample_index=sample,
            payload=p,
            reward=reward,
            reward_info=None,
            start=start,
        )


def _samples(engine: sa.Engine) -> list[Any]:
    return rows(
        engine,
        "SELECT sample_index, status::text, reward, lease_epoch, updated_at, "
        "(SELECT string_agg(s.token_ids, ''::bytea ORDER BY s.start_token) "
        " FROM trajectory_segments s WHERE s.episode_id = tr.episode_id "
        " AND s.sample_index = tr.sample_index) AS token_ids "
        "FROM trajectories tr ORDER BY sample_index",
    )


def _episode(engine: sa.Engine, episode_id: int) -> Any:
    return rows(
        engine,
        "SELECT status::text, lease_epoch, finished_at, min_policy_version, lease_owner "
        "FROM episodes WHERE id = :e",
        e=episode_id,
    )[0]


def test_upsert_is_idempotent_and_fenced(db: Database, engine: sa.Engine) -> None:
    c = _claim(db, group_size=2)
    # A checkpoint is overwritten by the next one while the sample is in progress ...
    assert _write(db, c, 0, payload(0, seed=1), None) == ("written", False)
    assert _write(db, c, 0, payload(0, seed=2), None) == ("written", False)
    (s,) = _samples(engine)
    assert (s.status, bytes(s.token_ids)) == (
        "in_progress",
        payload(0, seed=2).encoded()["token_ids"],
    )
    # ... a commit replaces it, and nothing replaces a commit: not a checkpoint, not a commit.
    assert _write(db, c, 0, payload(0, seed=3), 1.0) == ("written", False)
    committed = _samples(engine)
    assert _write(db, c, 0, payload(0, seed=4), None) == ("already", False)
    assert _write(db, c, 0, payload(0, seed=5), 0.0) == ("already", False)
    assert _samples(engine) == committed
    assert (committed[0].status, committed[0].reward) == ("ready", 1.0)
    assert bytes(committed[0].token_ids) == payload(0, seed=3).encoded()["token_ids"]
    # Fenced: a write under another epoch changes nothing, whether the sample exists or not.
    episode = _episode(engine, c.lease.episode_id)
    for epoch in (c.lease.epoch - 1, c.lease.epoch + 1):
        assert _write(db, c, 1, payload(0), 1.0, epoch=epoch) == ("stale", False)
        assert _write(db, c, 0, payload(0), None, epoch=epoch) == ("stale", False)
    with db.transaction() as tx:
        assert tx.trajectories.write_samples(
            episode_id=c.lease.episode_id,
            epoch=c.lease.epoch + 1,
            samples=[(0, payload(0), 1.0, None, 0), (1, payload(0), 1.0, None, 0)],
        ) == [("stale", False), ("stale", False)]
    assert _samples(engine) == committed
    assert _episode(engine, c.lease.episode_id) == episode


def test_group_completes_exactly_when_its_last_sample_lands(
    db: Database, engine: sa.Engine
) -> None:
    c = _claim(db, group_size=3)
    e = c.lease.episode_id
    assert _write(db, c, 0, payload(4), 1.0) == ("written", False)
    assert _write(db, c, 2, payload(2), None) == ("written", False)  # a checkpoint counts not
    assert _write(db, c, 1, payload(3), 1.0) == ("written", False)
    assert _episode(engine, e).status == "leased"
    # Several samples in one transaction: the one that makes the group whole completes it.
    with db.transaction() as tx:
        assert tx.trajectories.write_samples(
            episode_id=e,
            epoch=c.lease.epoch,
            samples=[(1, payload(3), 1.0, None, 0), (2, payload(2), 0.0, None, 0)],
        ) == [("already", False), ("written", True)]
    ep = _episode(engine, e)
    assert (ep.status, ep.min_policy_version, ep.lease_owner) == ("done", 2, None)
    assert ep.finished_at is not None
    assert [s.status for s in _samples(engine)] == ["ready"] * 3


def test_idempotent_commit_does_not_double_apply(db: Database, engine: sa.Engine) -> None:
    c = _claim(db, group_size=2)
    e = c.lease.episode_id
    assert _write(db, c, 0, payload(0, seed=1), 1.0) == ("written", False)
    assert _write(db, c, 1, payload(0, seed=2), 0.5) == ("written", True)
    samples, episode = _samples(engine), _episode(engine, e)
    # A commit retried after the group completed (its reply was lost) succeeds and writes nothing.
    assert _write(db, c, 1, payload(0, seed=3), 0.0) == ("already", True)
    with db.transaction() as tx:
        assert tx.trajectories.write_samples(
            episode_id=e,
            epoch=c.lease.epoch,
            samples=[
                (0, payload(0, seed=4), 0.0, None, 0),
                (1, payload(0, seed=5), 0.0, None, 0),
            ],
        ) == [("already", True), ("already", True)]
    assert _samples(engine) == samples
    assert _episode(engine, e) == episode
    assert scalar(engine, "SELECT count(*) FROM trajectories") == 2
    # A sample that was never committed is no retry: after completion it is stale.
    assert _write(db, c, 2, payload(0), 1.0) == ("stale", False)


def _segments(engine: sa.Engine, sample: int = 0) -> list[Any]:
    return rows(
        engine,
        "SELECT start_token, end_token, xmin::text AS xmin, octet_length(token_ids) AS nbytes "
        "FROM trajectory_segments WHERE sample_index = :s ORDER BY start_token",
        s=sample,
    )


def _stored(db: Database, c: ClaimedEpisode) -> TrajectoryPayload:
    with db.transaction() as tx:
        state = tx.trajectories.samples_for_resume(c.lease.task_id, c.lease.episode_id, 1)[0]
    assert state.checkpoint is not None
    return state.checkpoint


def payload_prefix(full: TrajectoryPayload, turns: int, per_turn: int) -> TrajectoryPayload:
    n = turns * per_turn
    return TrajectoryPayload.build(
        full.token_ids[:n],
        full.loss_mask[:n],
        full.behaviour_logprobs[:n],
        turn_offsets=[i * per_turn for i in range(turns)],
        turn_versions=[0] * turns,
        prompt_tokens=1,
        env_state={"turn": turns},
    )


def test_a_checkpoint_appends_its_new_turn_and_never_rewrites_earlier_ones(
    db: Database, engine: sa.Engine
) -> None:
    c = _claim(db, group_size=1)
    full = payload(0, n_tokens=40, turns=4, seed=7)
    assert _write(db, c, 0, payload_prefix(full, 1, 10), None) == ("written", False)
    first = _segments(engine)
    for turns in (2, 3):
        p = payload_prefix(full, turns, 10)
        assert _write(db, c, 0, p, None, start=10 * (turns - 1)) == ("written", False)
    segs = _segments(engine)
    # One segment per turn, each holding only its own turn's tokens; the first row is the
    # very row the first checkpoint wrote (same xmin: never updated or rewritten).
    assert [(s.start_token, s.end_token, s.nbytes) for s in segs] == [
        (0, 10, 40),
        (10, 20, 40),
        (20, 30, 40),
    ]
    assert segs[0] == first[0]
    assert _stored(db, c).same_as(payload_prefix(full, 3, 10))
    # A writer wrong about what is stored is told to write again from 0; nothing changes.
    assert _write(db, c, 0, full, None, start=25) == ("rebase", False)
    assert _write(db, c, 0, full, None, start=40) == ("rebase", False)
    assert _segments(engine) == segs
    # Repeating a write (its reply was lost) replaces the segments from its start on.
    assert _write(db, c, 0, payload_prefix(full, 3, 10), None, start=20) == ("written", False)
    assert [s.start_token for s in _segments(engine)] == [0, 10, 20]
    assert _segments(engine)[:2] == segs[:2]
    # The commit appends the last turn; the payload reads back whole.
    assert _write(db, c, 0, full, 1.0, start=30) == ("written", True)
    assert [s.start_token for s in _segments(engine)] == [0, 10, 20, 30]
    with db.transaction() as tx:
        (got,) = tx.batches.load_trajectories([(c.lease.episode_id, c.lease.task_id)])[
            c.lease.episode_id
        ]
    assert got.payload.same_as(full)


def test_a_trajectory_that_starts_over_is_written_whole(db: Database, engine: sa.Engine) -> None:
    c = _claim(db, group_size=1)
    assert _write(db, c, 0, payload(0, n_tokens=30, turns=3, seed=1), None) == ("written", False)
    other = payload(0, n_tokens=12, turns=1, seed=2)
    assert _write(db, c, 0, other, None, start=0) == ("written", False)
    assert [(s.start_token, s.end_token) for s in _segments(engine)] == [(0, 12)]
    assert _stored(db, c).same_as(other)


def test_the_buffer_sends_only_new_turns_and_a_resumed_claim_goes_on_appending(
    db: Database, engine: sa.Engine
) -> None:
    add_tasks(db, {"name": "a", "group_size": 1})
    buf = make_buffer(db, batch_groups=1)
    buf.seed()
    c = buf.claim(buf.register_worker("r0").id)
    assert c is not None
    full = payload(0, n_tokens=80, turns=8, seed=3)
    for turns in range(1, 5):
        buf.checkpoint(c.lease, 0, payload_prefix(full, turns, 10))
    assert [s.start_token for s in _segments(engine)] == [0, 10, 20, 30]
    # A trajectory that starts over (a diverged agent replay) is written whole, then appends.
    restart = payload_prefix(payload(0, n_tokens=80, turns=8, seed=4), 1, 10)
    buf.checkpoint(c.lease, 0, restart)
    assert [(s.start_token, s.end_token) for s in _segments(engine)] == [(0, 10)]
    for turns in range(1, 5):
        buf.checkpoint(c.lease, 0, payload_prefix(full, turns, 10))
    before = _segments(engine)
    # The node gives the episode back; another writer (a fresh Buffer: another process)
    # claims it, receives the checkpoint, and appends after it.
    buf.release(c.lease, "engine failed", counted=False)
    other = make_buffer(db, batch_groups=1)
    c2 = other.claim(other.register_worker("r1").id)
    assert c2 is not None and c2.lease.epoch > c.lease.epoch
    assert c2.samples[0].checkpoint is not None
    assert c2.samples[0].checkpoint.same_as(payload_prefix(full, 4, 10))
    other.checkpoint(c2.lease, 0, payload_prefix(full, 5, 10))
    other.commit(c2.lease, 0, full, 1.0)
    after = _segments(engine)
    assert after[:4] == before
    assert [(s.start_token, s.end_token) for s in after[4:]] == [(40, 50), (50, 80)]
    # The old holder's writes are fenced: nothing of them lands.
    with pytest.raises(StaleLeaseError):
        buf.checkpoint(c.lease, 0, payload_prefix(full, 6, 10))
    assert _segments(engine) == after


def _held_first_batch(rb: RolloutBuffer, others: int) -> list[int]:
    """Hold the group commit's first batch until ``others`` writes wait behind it, so they
    form the second batch together (what concurrent loops do when a write takes a while).
    Returns the batches' sizes as they are written."""
    real, sizes = rb.group_commit._write_batch, list[int]()

    def held(batch: list[Pending]) -> None:
        if not sizes:
            deadline = time.monotonic() + 30
            while len(rb.group_commit._queue) < others:
                assert time.monotonic() < deadline, "the other writes never queued"
                time.sleep(0.005)
        sizes.append(len(batch))
        real(batch)

    rb.group_commit._write_batch = held
    return sizes


def _in_threads(calls: dict[str, Callable[[], Any]], lead: Callable[[], Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def run(name: str, fn: Callable[[], Any]) -> None:
        try:
            out[name] = fn()
        except Exception as e:
            out[name] = e

    first = threading.Thread(target=run, args=("lead", lead))
    first.start()
    threads = [threading.Thread(target=run, args=kv) for kv in calls.items()]
    for t in threads:
        t.start()
    for t in [first, *threads]:
        t.join(60)
        assert not t.is_alive()
    return out


def test_concurrent_writes_share_one_transaction_and_each_keeps_its_own_outcome(
    db: Database, engine: sa.Engine
) -> None:
    """Group commit: a node's checkpoints and commits that wait together are written in one
    transaction, and each still gets its own fencing, outcome and stored payload."""
    tasks = add_tasks(db, {"name": "a", "group_size": 2})
    buf = make_buffer(db, batch_groups=3)
    buf.seed()
    rb = buf.rollout
    worker = buf.register_worker("r0").id
    c1, c2, c3 = (buf.claim(worker) for _ in range(3))
    assert c1 is not None and c2 is not None and c3 is not None
    buf.release(c3.lease, "engine failed", counted=False)  # c3's lease has moved on
    p = {k: payload(0, n_tokens=12, seed=k) for k in range(5)}
    sizes = _held_first_batch(rb, others=4)
    out = _in_threads(
        {
            "c1 commit 1": lambda: buf.commit(c1.lease, 1, p[1], 1.0),
            "c2 checkpoint 0": lambda: buf.checkpoint(c2.lease, 0, p[2]),
            "c2 commit 1": lambda: buf.commit(c2.lease, 1, p[3], 0.5),
            "c3 checkpoint 0": lambda: buf.checkpoint(c3.lease, 0, p[4]),
        },
        lead=lambda: buf.checkpoint(c1.lease, 0, p[0]),
    )
    assert sizes == [1, 4]  # the four that waited: one transaction
    assert (rb.group_commit.batches, rb.group_commit.writes) == (2, 5)
    assert out["lead"] is None and out["c2 checkpoint 0"] is None
    assert out["c1 commit 1"].committed == (1,) and not out["c1 commit 1"].group_done
    assert out["c2 commit 1"].committed == (1,)
    assert isinstance(out["c3 checkpoint 0"], StaleLeaseError)  # fenced alone
    stored = rows(
        engine,
        "SELECT episode_id, sample_index, status::text, reward FROM trajectories "
        "ORDER BY episode_id, sample_index",
    )
    e1, e2 = c1.lease.episode_id, c2.lease.episode_id
    assert [tuple(r) for r in stored] == [
        (e1, 0, "in_progress", None),
        (e1, 1, "ready", 1.0),
        (e2, 0, "in_progress", None),
        (e2, 1, "ready", 0.5),
    ]
    assert _stored(db, c1).same_as(p[0]) and _stored(db, c2).same_as(p[2])
    assert scalar(engine, "SELECT fenced_rejections FROM tasks WHERE id = :t", t=tasks["a"]) == 1


def test_a_write_that_fails_in_a_batch_fails_alone(db: Database, engine: sa.Engine) -> None:
    """A batch whose transaction fails for a reason of one write's (here a reward_info that
    is not JSON) is written again write by write: only that write's caller sees the error."""
    add_tasks(db, {"name": "a", "group_size": 2})
    buf = make_buffer(db, batch_groups=1)
    buf.seed()
    worker = buf.register_worker("r0").id
    c1, c2 = buf.claim(worker), buf.claim(worker)
    assert c1 is not None and c2 is not None
    sizes = _held_first_batch(buf.rollout, others=3)
    out = _in_threads(
        {
            "good commit": lambda: buf.commit(c1.lease, 1, payload(0, seed=1), 1.0),
            "bad commit": lambda: buf.commit(
                c2.lease, 0, payload(0, seed=2), 1.0, {"not json": object()}
            ),
            "good checkpoint": lambda: buf.checkpoint(c2.lease, 1, payload(0, seed=3)),
        },
        lead=lambda: buf.checkpoint(c1.lease, 0, payload(0, seed=4)),
    )
    assert sizes == [1, 3]
    assert isinstance(out["bad commit"], TypeError)
    assert out["good commit"].committed == (1,) and out["good checkpoint"] is None
    assert scalar(engine, "SELECT count(*) FROM trajectories") == 3
    assert scalar(engine, "SELECT count(*) FROM trajectories WHERE status = 'ready'") == 1


def test_a_lease_renewal_and_a_batch_of_writes_never_deadlock(
    db: Database, engine: sa.Engine
) -> None:
    """A node's group commit holds its batch's lease locks, taken in episode id order, until
    it commits; the heartbeat's renewal of the same node's leases must take them in the same
    order. Here the leases' rows lie in the heap in the reverse of id order (the first
    episode's row moved by a non-HOT update) and a batch holds the first episode's lock while
    the renewal runs: the renewal waits for it, holding nothing, and the batch then takes the
    second."""
    add_tasks(db, {"name": "a", "group_size": 1})
    buf = make_buffer(db, batch_groups=2)
    buf.seed()
    worker = buf.register_worker("r0").id
    cx, cy = buf.claim(worker), buf.claim(worker)
    assert cx is not None and cy is not None
    x, y = sorted((cx.lease.episode_id, cy.lease.episode_id))
    with engine.begin() as conn:  # x's row version after y's in the heap: a non-HOT update
        conn.execute(
            sa.text("UPDATE episodes SET leased_at = leased_at + interval '1 ms' WHERE id = :x"),
            {"x": x},
        )
        query = sa.text("SELECT id, ctid::text FROM episodes WHERE id IN (:x, :y)")
        ctids: dict[int, str] = dict(conn.execute(query, {"x": x, "y": y}).tuples().all())
    assert _tid(ctids[x]) > _tid(ctids[y]), ctids  # the reverse of id order
    with engine.connect() as a:
        a.execute(sa.text("SET deadlock_timeout = '200ms'"))
        a.execute(sa.text("SELECT id FROM episodes WHERE id = :x FOR SHARE"), {"x": x})
        out: dict[str, Any] = {}

        def renew() -> None:
            try:
                out["renewed"] = buf.beat(worker)
            except Exception as e:
                out["error"] = e

        t = threading.Thread(target=renew)
        t.start()
        deadline = time.monotonic() + 30
        while not rows(
            engine,
            "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE 'UPDATE episodes SET lease_expires_at%'",
        ):
            assert time.monotonic() < deadline, "the renewal never waited on the batch's lock"
            time.sleep(0.01)
        # the batch's next write: with the renewal holding y, this would be a deadlock
        a.execute(sa.text("SELECT id FROM episodes WHERE id = :y FOR SHARE"), {"y": y})
        a.commit()
        t.join(60)
    assert "error" not in out, out
    alive, leases = out["renewed"]
    assert alive and sorted(e for e, _ in leases) == [x, y]


def _tid(ctid: str) -> tuple[int, int]:
    page, item = ctid.strip("()").split(",")
    return int(page), int(item)
