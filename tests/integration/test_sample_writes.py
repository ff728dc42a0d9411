"""The write rules of a sample, each tested once, directly: ``rollcall_write_sample``
(migration 0002) through ``TrajectoryRepository.write_sample`` / ``write_samples``, the one
implementation the buffer's checkpoints and commits use."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from orchestrator.buffer.types import ClaimedEpisode
from orchestrator.db.engine import Database
from orchestrator.domain import TrajectoryPayload
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
) -> tuple[str, bool]:
    with db.autocommit() as tx:
        return tx.trajectories.write_sample(
            episode_id=c.lease.episode_id,
            epoch=c.lease.epoch if epoch is None else epoch,
            sample_index=sample,
            payload=p,
            reward=reward,
            reward_info=None,
        )


def _samples(engine: sa.Engine) -> list[Any]:
    return rows(
        engine,
        "SELECT sample_index, status::text, reward, token_ids, lease_epoch, updated_at "
        "FROM trajectories ORDER BY sample_index",
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
            samples=[(0, payload(0), 1.0, None), (1, payload(0), 1.0, None)],
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
            samples=[(1, payload(3), 1.0, None), (2, payload(2), 0.0, None)],
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
            samples=[(0, payload(0, seed=4), 0.0, None), (1, payload(0, seed=5), 0.0, None)],
        ) == [("already", True), ("already", True)]
    assert _samples(engine) == samples
    assert _episode(engine, e) == episode
    assert scalar(engine, "SELECT count(*) FROM trajectories") == 2
    # A sample that was never committed is no retry: after completion it is stale.
    assert _write(db, c, 2, payload(0), 1.0) == ("stale", False)
