"""The rollout side of the buffer: seeding, claims, quotas, fencing, resume, quarantine."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import sqlalchemy as sa

from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.domain import WorkerStatus
from rollcall.orchestrator.errors import StaleLeaseError
from rollcall.orchestrator.services.tasks import change_status, set_quota
from tests.integration.buffer_helpers import (
    add_tasks,
    drain_queue,
    finish,
    make_buffer,
    payload,
    rows,
    scalar,
)


def test_seeding_fills_each_task_to_its_admission_cap(db: Database, engine: sa.Engine) -> None:
    ids = add_tasks(
        db,
        {"name": "a", "weight": 2, "max_staleness": 1},
        {"name": "b", "weight": 1, "max_staleness": 3},
    )
    buf = make_buffer(db, batch_groups=6)
    # Shares of 6 groups at 2:1 are 4 and 2; caps (1+1)*4 = 8 and (3+1)*2 = 8.
    assert buf.seed() == {"a": 8, "b": 8}
    assert buf.seed() == {}
    w = buf.register_worker("r0")
    # Finished but untrained groups still count as outstanding: nothing new is seeded.
    drain_queue(buf, w.id, version=0)
    assert buf.seed() == {}
    counts = dict(rows(engine, "SELECT task_id, count(*) FROM episodes GROUP BY task_id"))
    assert counts == {ids["a"]: 8, ids["b"]: 8}


def test_prompt_stream_neither_repeats_nor_skips_across_restarts(
    db: Database, engine: sa.Engine, db_url: str
) -> None:
    from rollcall.orchestrator.db.engine import open_database

    ids = add_tasks(db, {"name": "a", "max_staleness": 0})
    make_buffer(db, batch_groups=2).seed()  # cap 2
    # "Restart": a new process-like Buffer on a new connection pool consumes and re-seeds.
    db2 = open_database(db_url)
    buf2 = make_buffer(db2, batch_groups=2)
    w = buf2.register_worker("r0")
    drain_queue(buf2, w.id, version=0)
    batch = buf2.claim_batch(0)
    assert len(batch.groups) == 2
    buf2.commit_step(0)
    assert buf2.seed() == {"a": 2}
    db2.dispose()
    indexes = [
        r[0]
        for r in rows(
            engine, "SELECT prompt_index FROM episodes WHERE task_id = :t ORDER BY id", t=ids["a"]
        )
    ]
    assert indexes == [0, 1, 2, 3]
    assert scalar(engine, "SELECT prompt_cursor FROM tasks WHERE id = :t", t=ids["a"]) == 4
    # The prompts are the plugin's stream at those indexes.
    from rollcall.tasks.echo import EchoSpec, EchoTask

    prompts = [r[0] for r in rows(engine, "SELECT prompt FROM episodes ORDER BY id")]
    assert prompts == [EchoTask().prompt(EchoSpec(group_size=2), i) for i in range(4)]


def test_paused_and_draining_tasks_are_not_seeded(db: Database) -> None:
    add_tasks(db, {"name": "a"}, {"name": "b"}, {"name": "c"})
    with db.transaction() as tx:
        change_status(tx, job_name="default", name="b", action="pause", actor="t")
        change_status(tx, job_name="default", name="c", action="drain", actor="t")
    added = make_buffer(db, batch_groups=4).seed()
    assert set(added) == {"a"}


def test_claims_respect_max_inflight_pause_and_set_quota(db: Database, engine: sa.Engine) -> None:
    ids = add_tasks(db, {"name": "a", "max_inflight": 2, "max_staleness": 4})
    buf = make_buffer(db, batch_groups=4)
    buf.seed()
    w = buf.register_worker("r0")
    claims = [buf.claim(w.id) for _ in range(3)]
    assert [c is not None for c in claims] == [True, True, False]

    with db.transaction() as tx:
        set_quota(tx, job_name="default", name="a", max_inflight=3, actor="t")
    c3 = buf.claim(w.id)  # takes effect on the next claim
    assert c3 is not None
    assert buf.claim(w.id) is None
    leased = scalar(
        engine, "SELECT count(*) FROM episodes WHERE task_id = :t AND status = 'leased'", t=ids["a"]
    )
    assert leased == 3

    with db.transaction() as tx:
        change_status(tx, job_name="default", name="a", action="pause", actor="t")
        set_quota(tx, job_name="default", name="a", max_inflight=10, actor="t")
    assert buf.claim(w.id) is None  # paused: no new claims ...
    c = claims[0]
    assert c is not None
    finish(buf, c, version=0)  # ... but in-flight work finishes
    with db.transaction() as tx:
        change_status(tx, job_name="default", name="a", action="drain", actor="t")
    assert buf.claim(w.id) is not None  # draining: queued work is finished, nothing seeded


def test_claims_follow_weights(db: Database) -> None:
    add_tasks(
        db,
        {"name": "a", "weight": 3, "max_staleness": 20, "max_inflight": 1000},
        {"name": "b", "weight": 1, "max_staleness": 20, "max_inflight": 1000},
    )
    buf = make_buffer(db, batch_groups=8, claim_window_s=604_800)  # a week: the longest window
    buf.seed()
    w = buf.register_worker("r0")
    got = Counter(buf.claim(w.id).task_name for _ in range(40))  # type: ignore[union-attr]
    assert got == {"a": 30, "b": 10}


def test_fencing_rejects_stale_writes_and_changes_nothing(db: Database, engine: sa.Engine) -> None:
    ids = add_tasks(db, {"name": "a", "group_size": 2})
    buf = make_buffer(db, batch_groups=1, max_attempts=5)
    buf.seed()
    w1 = buf.register_worker("r0")
    c1 = buf.claim(w1.id)
    assert c1 is not None
    buf.checkpoint(c1.lease, 0, payload(0, seed=1))
    buf.requeue_worker(w1.id)  # w1 declared dead; its lease moves on

    before = rows(engine, "SELECT * FROM trajectories ORDER BY episode_id, sample_index")
    episodes_before = rows(engine, "SELECT * FROM episodes ORDER BY id")
    with pytest.raises(StaleLeaseError):
        buf.checkpoint(c1.lease, 0, payload(0, seed=2))
    with pytest.raises(StaleLeaseError):
        buf.commit(c1.lease, 1, payload(0), 1.0)
    with pytest.raises(StaleLeaseError):
        buf.commit(c1.lease, 0, payload(0), 1.0)
    assert rows(engine, "SELECT * FROM trajectories ORDER BY episode_id, sample_index") == before
    assert rows(engine, "SELECT * FROM episodes ORDER BY id") == episodes_before
    assert scalar(engine, "SELECT fenced_rejections FROM tasks WHERE id = :t", t=ids["a"]) == 3

    # The new holder writes normally; a zombie commit after it completed is still rejected.
    w2 = buf.register_worker("r1")
    c2 = buf.claim(w2.id)
    assert c2 is not None and c2.lease.episode_id == c1.lease.episode_id
    assert c2.lease.epoch > c1.lease.epoch
    finish(buf, c2, version=0)
    with pytest.raises(StaleLeaseError):
        buf.commit(c1.lease, 0, payload(0), 0.0)


def test_commit_results_report_what_was_written(db: Database) -> None:
    """What ``commit`` reports; the write rules behind them (no overwrite,
    group completion, idempotent re-commit) are tested in test_sample_writes.py."""
    add_tasks(db, {"name": "a", "group_size": 3})
    buf = make_buffer(db, batch_groups=1)
    buf.seed()
    w = buf.register_worker("r0")
    c = buf.claim(w.id)
    assert c is not None
    r1 = buf.commit(c.lease, 0, payload(0), 1.0)
    assert (r1.committed, r1.already, r1.group_done) == ((0,), (), False)
    r2 = buf.commit(c.lease, 0, payload(0), 0.0)  # retried commit: no change
    assert (r2.committed, r2.already, r2.group_done) == ((), (0,), False)
    r3 = buf.commit(c.lease, 1, payload(0), 0.5)
    assert (r3.committed, r3.already, r3.group_done) == ((1,), (), False)
    r4 = buf.commit(c.lease, 2, payload(0), 0.5)  # the group's last sample completes it
    assert (r4.committed, r4.already, r4.group_done) == ((2,), (), True)
    r5 = buf.commit(c.lease, 0, payload(0), 1.0)
    assert (r5.committed, r5.already, r5.group_done) == ((), (0,), True)  # after completion
    r6 = buf.commit(c.lease, 1, payload(0), 0.5)
    assert (r6.committed, r6.already, r6.group_done) == ((), (1,), True)


def test_resume_hands_checkpoints_to_the_next_claimer(db: Database, engine: sa.Engine) -> None:
    add_tasks(db, {"name": "a", "group_size": 3})
    buf = make_buffer(db, batch_groups=1, lease_s=0.2)
    buf.seed()
    w1 = buf.register_worker("r0")
    c1 = buf.claim(w1.id)
    assert c1 is not None and [s.status for s in c1.samples] == ["new", "new", "new"]
    turn1 = payload(0, n_tokens=12, turns=2, seed=5)
    buf.checkpoint(c1.lease, 0, turn1)
    buf.commit(c1.lease, 1, payload(0, seed=6), 1.0)

    import time

    time.sleep(0.3)  # the lease expires on the database clock
    swept = buf.sweep_expired_leases()
    assert swept.requeued == 1 and swept.episode_ids == (c1.lease.episode_id,)
    assert buf.sweep_expired_leases().requeued == 0

    w2 = buf.register_worker("r1")
    c2 = buf.claim(w2.id)
    assert c2 is not None and c2.lease.episode_id == c1.lease.episode_id
    assert c2.attempts == 2 and c2.resumed
    assert [s.status for s in c2.samples] == ["in_progress", "ready", "new"]
    ck = c2.samples[0].checkpoint
    assert ck is not None and ck.same_as(turn1)

    # Continue sample 0 from its checkpoint: earlier turns unchanged, one more turn appended.
    cont = payload(1, n_tokens=4, seed=7)
    longer = type(ck).build(
        np.concatenate([ck.token_ids, cont.token_ids]),
        np.concatenate([ck.loss_mask, cont.loss_mask]),
        np.concatenate([ck.behaviour_logprobs, cont.behaviour_logprobs]),
        turn_offsets=[*ck.turn_offsets, len(ck.token_ids)],
        turn_versions=[*ck.turn_versions, 1],
        prompt_tokens=ck.prompt_tokens,
    )
    buf.commit(c2.lease, 0, longer, 0.0)
    assert buf.commit(c2.lease, 2, payload(1), 1.0).group_done
    stored = rows(
        engine,
        "SELECT turn_versions, min_policy_version, num_tokens FROM trajectories WHERE sample_index = 0",
    )
    assert stored == [([0, 0, 1], 0, 16)]
    assert (
        scalar(
            engine, "SELECT min_policy_version FROM episodes WHERE id = :e", e=c2.lease.episode_id
        )
        == 0
    )
    assert scalar(engine, "SELECT requeued_leases FROM tasks") == 1


@pytest.mark.parametrize("how", ["give_back", "release_uncounted"])
def test_an_uncounted_requeue_still_hands_checkpoints_to_the_next_claimer(
    db: Database, how: str
) -> None:
    """An engine failure gives the episode back without counting the claim as an attempt (its
    ``attempts`` go back to 0); the next claimer must still resume its checkpointed samples,
    not start them again."""
    add_tasks(db, {"name": "a", "group_size": 2})
    buf = make_buffer(db, batch_groups=1)
    buf.seed()
    w1 = buf.register_worker("r0")
    c1 = buf.claim(w1.id)
    assert c1 is not None and c1.attempts == 1
    turn1 = payload(0, n_tokens=12, turns=2, seed=5)
    buf.checkpoint(c1.lease, 0, turn1)
    if how == "give_back":
        assert buf.give_back(w1.id, "the engine died").requeued == 1
    else:
        buf.release(c1.lease, "the engine died", counted=False)
    w2 = buf.register_worker("r1")
    c2 = buf.claim(w2.id)
    assert c2 is not None and c2.lease.episode_id == c1.lease.episode_id
    assert c2.attempts == 1  # not counted
    assert [s.status for s in c2.samples] == ["in_progress", "new"]
    ck = c2.samples[0].checkpoint
    assert ck is not None and ck.same_as(turn1)


def test_poison_episode_is_quarantined_and_others_keep_going(
    db: Database, engine: sa.Engine
) -> None:
    ids = add_tasks(
        db,
        {"name": "bad", "group_size": 1, "max_staleness": 0},
        {"name": "good", "group_size": 1, "max_staleness": 0},
    )
    buf = make_buffer(db, batch_groups=2, max_attempts=2)
    buf.seed()
    w = buf.register_worker("r0")
    good_done = 0
    for _ in range(10):
        c = buf.claim(w.id)
        if c is None:
            break
        if c.task_name == "bad":
            buf.release(c.lease, "tool crashed")
        else:
            finish(buf, c, version=0)
            good_done += 1
    assert good_done == 1  # the good task's whole queue (cap 1) finished
    status = dict(rows(engine, "SELECT task_id, status::text FROM episodes"))
    assert status == {ids["bad"]: "quarantined", ids["good"]: "done"}
    assert scalar(engine, "SELECT quarantined_episodes FROM tasks WHERE id = :t", t=ids["bad"]) == 1
    ev = rows(
        engine, "SELECT kind, task_id, payload FROM events WHERE kind = 'episode.quarantined'"
    )
    assert len(ev) == 1 and ev[0][1] == ids["bad"] and "tool crashed" in ev[0][2]["reason"]


def test_heartbeat_renews_leases_and_reports_lost_ones(db: Database, engine: sa.Engine) -> None:
    add_tasks(db, {"name": "a", "group_size": 1})
    buf = make_buffer(db, batch_groups=2, lease_s=30)
    buf.seed()
    w = buf.register_worker("r0")
    c1, c2 = buf.claim(w.id), buf.claim(w.id)
    assert c1 is not None and c2 is not None
    before = scalar(engine, "SELECT max(lease_expires_at) FROM episodes")
    alive, held = buf.beat(w.id, tokens_generated=5)
    assert alive and sorted(held) == sorted(
        [(c1.lease.episode_id, c1.lease.epoch), (c2.lease.episode_id, c2.lease.epoch)]
    )
    assert scalar(engine, "SELECT max(lease_expires_at) FROM episodes") > before
    assert scalar(engine, "SELECT tokens_generated FROM workers WHERE id = :w", w=w.id) == 5
    buf.requeue_worker(w.id, WorkerStatus.DEAD)
    assert buf.beat(w.id) == (False, [])  # a dead worker holds nothing and is told so
