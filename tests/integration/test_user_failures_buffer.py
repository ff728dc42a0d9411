"""The buffer's side of user code that fails (real PostgreSQL): a failed episode is retried
after a backoff, first by another worker; quarantined after its attempts; a task the guard
pauses keeps its reason until an operator resumes it; NaN rewards already stored never reach a
batch, also when a step had reserved them."""

from __future__ import annotations

import time
from typing import Any

import pytest
import sqlalchemy as sa

from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.services.tasks import change_status
from tests.integration.buffer_helpers import add_tasks, finish, make_buffer, payload, rows, scalar


def _failure(**extra: Any) -> dict[str, Any]:
    return {
        "error": "the agent raised RuntimeError: inventory service returned 500",
        "location": "agent.py:7 in check_stock",
        "traceback": "Traceback ...",
        "signature": "abc",
        "head": "the agent raised RuntimeError",
        "task": "a",
        "prompt_index": 0,
        **extra,
    }


def _claim_until(buf: Any, worker: int, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (c := buf.claim(worker)) is not None:
            return c
        time.sleep(0.02)
    return None


def test_a_failed_episode_waits_out_its_backoff_and_goes_to_another_worker_first(
    db: Database, engine: sa.Engine
) -> None:
    add_tasks(db, {"name": "a", "max_staleness": 0})
    buf = make_buffer(db, batch_groups=1, max_attempts=3)
    buf.seed()  # one episode
    w1, w2 = buf.register_worker("r0").id, buf.register_worker("r1").id
    claim = buf.claim(w1)
    assert claim is not None
    out = buf.fail_user_code(claim.lease, _failure(), backoff_s=1.0)
    assert (out.quarantined, out.attempt, out.retry_in_s) == (False, 1, 1.0)
    t0 = time.monotonic()
    assert buf.claim(w2) is None and buf.claim(w1) is None  # backoff: nobody yet
    # another worker after the backoff; the one it failed on only after twice that
    again = _claim_until(buf, w2)
    assert again is not None and again.lease.episode_id == claim.lease.episode_id
    assert 0.8 <= time.monotonic() - t0 < 2.0
    out = buf.fail_user_code(again.lease, _failure(), backoff_s=1.0)
    assert out.retry_in_s == 2.0  # 1 s x 2^(attempt - 1)
    t0 = time.monotonic()
    third = _claim_until(buf, w2)  # the worker it failed on last: 2 x 2 s
    assert third is not None and time.monotonic() - t0 >= 3.8
    out = buf.fail_user_code(third.lease, _failure(), backoff_s=1.0)
    assert out.quarantined and out.retry_in_s is None
    status, error = rows(engine, "SELECT status::text, last_error FROM episodes")[0]
    assert status == "quarantined"
    assert error == (
        "user code: the agent raised RuntimeError: inventory service returned 500 "
        "(agent.py:7 in check_stock)"
    )
    events = rows(engine, "SELECT message, payload, worker_id FROM events "
                  "WHERE kind = 'episode.user_error' ORDER BY id")  # fmt: skip
    assert [p["attempt"] for _, p, _ in events] == [1, 2, 3]
    assert [w for *_, w in events] == [w1, w2, w2]
    message, p, _ = events[0]
    assert message == (
        f"task a, episode {claim.lease.episode_id} (prompt 0): the agent raised RuntimeError: "
        "inventory service returned 500 at agent.py:7 in check_stock; attempt 1 of 3, "
        "retried in 1 s"
    )
    assert p["traceback"] == "Traceback ..." and p["retry_in_s"] == 1.0
    assert "quarantined" in events[-1][0]
    assert scalar(engine, "SELECT quarantined_episodes FROM tasks") == 1


def test_a_stale_lease_cannot_fail_an_episode(db: Database) -> None:
    from rollcall.orchestrator.errors import StaleLeaseError

    add_tasks(db, {"name": "a"})
    buf = make_buffer(db, batch_groups=1)
    buf.seed()
    w = buf.register_worker("r0").id
    claim = buf.claim(w)
    assert claim is not None
    buf.requeue_worker(w)
    with pytest.raises(StaleLeaseError):
        buf.fail_user_code(claim.lease, _failure(), backoff_s=1.0)


def test_a_task_paused_by_the_guard_keeps_its_reason_until_resumed(
    db: Database, engine: sa.Engine, cli: Any
) -> None:
    ids = add_tasks(db, {"name": "a"})
    buf = make_buffer(db)
    reason = "its code failed on 5 of its last 8 episodes (most often, 5 times: x at y)"
    guard = "rollout-0 (user-code guard)"
    assert buf.pause_task(ids["a"], reason, guard, {"failed": 5}) == "paused"
    assert buf.pause_task(ids["a"], reason, guard, {}) == "not_active"  # paused already
    task = buf.tasks()[0]
    assert task.status.value == "paused" and task.status_reason == reason
    message, actor, p = rows(engine, "SELECT message, actor, payload FROM events "
                             "WHERE kind = 'task.paused'")[0]  # fmt: skip
    assert message == (
        f"task 'a' paused: {reason}; fix the code, then `rollcall task resume a --job default` "
        "(rollout nodes load the fixed code when they start: `rollcall run CONFIG --resume`)"
    )
    assert actor == "rollout-0 (user-code guard)" and p["failed"] == 5 and p["from"] == "active"
    status = cli("status", "--job", "default")
    assert f"task 'a' paused: {reason}" in status.out, status.out
    with db.transaction() as tx:
        before_resume = tx.workers.db_now()
    r = cli("task", "resume", "a")
    assert r.code == 0, r.err
    assert buf.tasks()[0].status_reason is None
    # a node whose counted failures are from before the resume does not pause it again
    assert buf.pause_task(ids["a"], reason, guard, {}, failures_since=before_resume) == "resumed"
    assert buf.tasks()[0].status.value == "active"
    with db.transaction() as tx:  # an operator's own pause carries no reason
        change_status(tx, job_name="default", name="a", action="pause", actor="op")
    assert buf.tasks()[0].status_reason is None


def _nan(engine: sa.Engine, episode: int, value: str = "NaN") -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE trajectories SET reward = CAST(:v AS float8) WHERE episode_id = :e"),
            {"v": value, "e": episode},
        )


def test_nan_rewards_already_stored_are_quarantined_never_batched(
    db: Database, engine: sa.Engine
) -> None:
    add_tasks(db, {"name": "a", "max_staleness": 4})
    buf = make_buffer(db, batch_groups=2)
    buf.seed()
    w = buf.register_worker("r0").id
    claims = [buf.claim(w) for _ in range(4)]
    for c in claims:
        assert c is not None
        finish(buf, c, version=0)
    first, second = (c.lease.episode_id for c in claims[:2])  # type: ignore[union-attr]
    # the batch of step 0 was reserved (the trainer died before committing); then the rows
    # of one of its groups turned out NaN (written by an older rollcall), and another ready
    # group's infinite
    batch = buf.claim_batch(0, min_groups=2)
    assert {g.episode_id for g in batch.groups} == {first, second}
    _nan(engine, first)
    _nan(engine, claims[2].lease.episode_id, "Infinity")  # type: ignore[union-attr]
    buf.release_trainer_claims()
    # a new driver (--resume) replays step 0: the NaN group is gone
    buf = make_buffer(db, batch_groups=2)
    batch = buf.claim_batch(0, min_groups=2)
    got = {g.episode_id for g in batch.groups}
    assert first not in got and claims[2].lease.episode_id not in got  # type: ignore[union-attr]
    assert got == {second, claims[3].lease.episode_id}  # type: ignore[union-attr]
    for g in batch.groups:
        assert all(t.reward == t.reward for t in g.trajectories)  # no NaN
    quarantined = rows(engine, "SELECT id, last_error FROM episodes WHERE status = 'quarantined' "
                       "ORDER BY id")  # fmt: skip
    assert [q[0] for q in quarantined] == [first, claims[2].lease.episode_id]  # type: ignore[union-attr]
    assert all("non-finite reward" in q[1] for q in quarantined)
    events = rows(engine, "SELECT message FROM events WHERE kind = 'episode.quarantined'")
    assert any("rewards [nan, nan] are not all finite numbers" in m for (m,) in events), events
    commit = buf.commit_step(0)
    assert commit.groups == 2
    # a finished group with a NaN reward never reaches a batch: the commit refuses it
    with pytest.raises(ValueError, match="is not a finite number"):
        buf.commit(claims[0].lease, 0, payload(0), float("nan"))  # type: ignore[union-attr]


def test_a_group_with_no_token_is_quarantined_with_its_samples_reason(
    db: Database, engine: sa.Engine
) -> None:
    """An agent's prompt too long for its first call records no token at all: the quarantine
    said "its prompt is 0 tokens"; it now gives the samples' own reason."""
    from rollcall.orchestrator.domain import TrajectoryPayload

    add_tasks(db, {"name": "a"})
    buf = make_buffer(db, batch_groups=1)
    buf.seed()
    claim = buf.claim(buf.register_worker("r0").id)
    assert claim is not None
    reason = "limit: the prompt alone is 262151 tokens, at or over rollout.max_tokens (256)"
    empty = TrajectoryPayload.build(
        [], [], [], env_state={"state": {}, "answer": None, "stop_reason": reason}, finished=True
    )
    for s in claim.samples:
        buf.commit(claim.lease, s.sample_index, empty, 0.0)
    buf.expire_stale()
    (message,) = rows(engine, "SELECT message FROM events WHERE kind = 'episode.quarantined'")[0]
    assert message == (
        f"episode {claim.lease.episode_id} quarantined: none of its samples generated a token "
        f"({reason}); raise rollout.max_tokens or shorten the task's prompts"
    )
    assert "0 tokens" not in message
