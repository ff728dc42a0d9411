"""The trainer side of the buffer: batch claims by quota and staleness, atomic step commits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import sqlalchemy as sa

from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.domain import TrajectoryPayload
from rollcall.orchestrator.errors import ConflictError
from rollcall.orchestrator.quotas import batch_shares
from rollcall.orchestrator.services.tasks import change_status
from tests.integration.buffer_helpers import (
    Buffers,
    add_tasks,
    drain_queue,
    episode_end_states,
    finish,
    make_buffer,
    payload,
    rows,
    scalar,
)


def test_step_commit_consumes_batch_and_bumps_version(db: Database, engine: sa.Engine) -> None:
    add_tasks(db, {"name": "a", "group_size": 2, "max_staleness": 0})
    buf = make_buffer(db, batch_groups=2)
    buf.seed()
    w = buf.register_worker("r0")
    drain_queue(buf, w.id, version=0)
    batch = buf.claim_batch(0)
    assert len(batch.groups) == 2 and batch.num_trajectories == 4 and not batch.replayed
    assert all(len(g.trajectories) == 2 for g in batch.groups)
    assert (
        scalar(
            engine,
            "SELECT count(*) FROM trajectories WHERE status = 'claimed' AND claimed_step = 0",
        )
        == 4
    )

    commit = buf.commit_step(0, checkpoint_uri="file:///ckpt/0", metrics={"loss": 0.5})
    assert (commit.policy_version, commit.groups, commit.trajectories) == (1, 2, 4)
    assert scalar(engine, "SELECT policy_version FROM jobs WHERE id = 1") == 1
    assert scalar(engine, "SELECT count(*) FROM trajectories WHERE status = 'consumed'") == 4
    step = rows(
        engine,
        "SELECT step, policy_version, num_trajectories, checkpoint_uri, metrics, task_mix FROM train_steps",
    )
    assert step[0][:5] == (0, 1, 4, "file:///ckpt/0", {"loss": 0.5})
    assert step[0][5]["1"]["groups"] == 2
    # Committing the same step again changes nothing; the next step must be 1.
    assert buf.commit_step(0).already_committed
    assert scalar(engine, "SELECT policy_version FROM jobs WHERE id = 1") == 1
    with pytest.raises(ConflictError):
        buf.claim_batch(0)
    with pytest.raises(ConflictError, match="no claimed batch"):
        buf.commit_step(1)


def test_trainer_failure_between_claim_and_commit_replays_the_same_batch(
    db: Database, engine: sa.Engine
) -> None:
    add_tasks(
        db,
        {"name": "a", "weight": 1, "max_staleness": 2},
        {"name": "b", "weight": 1, "max_staleness": 2},
    )
    buf = make_buffer(db, batch_groups=4)
    buf.seed()
    w = buf.register_worker("r0")
    drain_queue(buf, w.id, version=0)

    class TrainerCrash(Exception):
        pass

    first = buf.claim_batch(0)
    with pytest.raises(TrainerCrash):
        # The trainer trains, then dies before the commit.
        raise TrainerCrash
    assert buf.release_trainer_claims() == first.num_trajectories
    assert scalar(engine, "SELECT count(*) FROM trajectories WHERE status = 'claimed'") == 0
    assert scalar(engine, "SELECT policy_version FROM jobs") == 0

    again = buf.claim_batch(0)
    assert again.replayed
    assert [g.episode_id for g in again.groups] == [g.episode_id for g in first.groups]
    assert again.task_mix == first.task_mix
    assert buf.commit_step(0).trajectories == first.num_trajectories
    # Nothing was trained twice and nothing was left behind.
    assert (
        scalar(engine, "SELECT count(*) FROM trajectories WHERE status = 'consumed'")
        == first.num_trajectories
    )
    assert (
        scalar(
            engine,
            "SELECT count(DISTINCT consumed_step) FROM episodes WHERE consumed_step IS NOT NULL",
        )
        == 1
    )


TRAINER = textwrap.dedent(
    """
    import os, sys, time
    from rollcall.orchestrator.db.engine import open_database
    from rollcall.orchestrator.buffer.trainer import TrainerBuffer
    from rollcall.orchestrator.config import BufferConfig
    db = open_database(os.environ["URL"])
    buf = TrainerBuffer(db, 1, BufferConfig(batch_groups=3))
    batch = buf.claim_batch(0)
    print(",".join(str(g.episode_id) for g in batch.groups), flush=True)
    time.sleep(600)  # "training": killed here, before commit_step
    """
)


def test_sigkilled_trainer_leaves_claims_for_the_sweep(
    db: Database, db_url: str, engine: sa.Engine
) -> None:
    add_tasks(db, {"name": "a", "max_staleness": 1})
    buf = make_buffer(db, batch_groups=3)
    buf.seed()
    w = buf.register_worker("r0")
    drain_queue(buf, w.id, version=0)
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINER],
        env={**os.environ, "URL": db_url},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    claimed = [int(x) for x in proc.stdout.readline().strip().split(",")]
    assert len(claimed) == 3
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert scalar(engine, "SELECT count(*) FROM trajectories WHERE status = 'claimed'") == 6
    assert buf.release_trainer_claims() == 6
    replay = buf.claim_batch(0)
    assert replay.replayed and [g.episode_id for g in replay.groups] == claimed
    assert buf.commit_step(0).groups == 3


def test_staleness_bound_per_task_and_expiry_requeues(db: Database, engine: sa.Engine) -> None:
    ids = add_tasks(
        db,
        {"name": "tight", "max_staleness": 0, "group_size": 1},
        {"name": "loose", "max_staleness": 2, "group_size": 1},
    )
    buf = make_buffer(db, batch_groups=2)
    w = buf.register_worker("r0")
    # Generate one group per task at version 0, then advance the version twice with other data.
    buf.seed()
    drain_queue(buf, w.id, version=0)
    consumed_versions: list[tuple[int, int, int]] = []  # (task, trained at version, generated)
    for step in range(6):
        batch = buf.claim_batch(step)
        for g in batch.groups:
            consumed_versions.append((g.task_id, step, g.min_policy_version))
        if batch.groups:
            buf.commit_step(step)
        else:
            # Nothing eligible: generate fresh data at the current version, then retry.
            buf.seed()
            drain_queue(buf, w.id, version=step)
            batch = buf.claim_batch(step)
            assert batch.groups
            consumed_versions += [(g.task_id, step, g.min_policy_version) for g in batch.groups]
            buf.commit_step(step)
        buf.seed()
        drain_queue(buf, w.id, version=max(0, step - 1))  # data one version behind
    bound = {ids["tight"]: 0, ids["loose"]: 2}
    assert consumed_versions
    for task, trained_at, generated in consumed_versions:
        assert trained_at - generated <= bound[task], (task, trained_at, generated)
    # The tight task's one-version-behind groups expired; each was requeued as a new episode.
    expired = scalar(
        engine,
        "SELECT count(*) FROM episodes WHERE status = 'expired' AND task_id = :t",
        t=ids["tight"],
    )
    requeued = scalar(
        engine,
        "SELECT count(*) FROM episodes WHERE requeued_from IS NOT NULL AND task_id = :t",
        t=ids["tight"],
    )
    assert expired > 0 and requeued == expired
    assert (
        scalar(engine, "SELECT expired_groups FROM tasks WHERE id = :t", t=ids["tight"]) == expired
    )
    loose_trained = [v for v in consumed_versions if v[0] == ids["loose"] and v[1] - v[2] > 0]
    assert loose_trained  # the loose task did train on data one or two versions old
    # Every trained trajectory is within its task's bound (checked on the stored rows).
    bad = scalar(
        engine,
        "SELECT count(*) FROM trajectories tr JOIN tasks t ON t.id = tr.task_id "
        "WHERE tr.status = 'consumed' AND tr.claimed_step - tr.min_policy_version > t.max_staleness",
    )
    assert bad == 0


def _feed(buf: Buffers, w: int, version: int) -> None:
    buf.seed()
    drain_queue(buf, w, version)


def test_batch_mix_follows_weights_within_one_group(db: Database) -> None:
    ids = add_tasks(
        db,
        {"name": "a", "weight": 3, "max_staleness": 4, "group_size": 1, "max_inflight": 100},
        {"name": "b", "weight": 2, "max_staleness": 4, "group_size": 1, "max_inflight": 100},
        {"name": "c", "weight": 1, "max_staleness": 4, "group_size": 1, "max_inflight": 100},
    )
    buf = make_buffer(db, batch_groups=7)
    w = buf.register_worker("r0").id
    total: Counter[int] = Counter()
    steps = 12
    for step in range(steps):
        _feed(buf, w, step)
        batch = buf.claim_batch(step)
        assert len(batch.groups) == 7
        total.update(g.task_id for g in batch.groups)
        buf.commit_step(step)
    shares = batch_shares({ids["a"]: 3, ids["b"]: 2, ids["c"]: 1}, 7)
    for t, share in shares.items():
        assert abs(total[t] - steps * share) <= 1.0, (t, total[t], steps * share)


def test_paused_or_empty_task_does_not_reduce_the_others(db: Database) -> None:
    ids = add_tasks(
        db,
        {"name": "a", "weight": 2, "max_staleness": 4, "group_size": 1, "max_inflight": 100},
        {"name": "b", "weight": 1, "max_staleness": 4, "group_size": 1, "max_inflight": 100},
        {"name": "paused", "weight": 3, "max_staleness": 4, "group_size": 1, "max_inflight": 100},
    )
    with db.transaction() as tx:
        change_status(tx, job_name="default", name="paused", action="pause", actor="t")
    buf = make_buffer(db, batch_groups=6)
    w = buf.register_worker("r0").id
    total: Counter[int] = Counter()
    for step in range(9):
        _feed(buf, w, step)
        batch = buf.claim_batch(step)
        assert len(batch.groups) == 6  # the paused task's share is redistributed, all slots used
        assert batch.task_mix[str(ids["paused"])]["shortfall"] == pytest.approx(3.0)  # recorded
        total.update(g.task_id for g in batch.groups)
        buf.commit_step(step)
    # a and b split the whole batch 2:1: 36 and 18 of 54.
    assert abs(total[ids["a"]] - 36) <= 1 and abs(total[ids["b"]] - 18) <= 1
    assert total[ids["paused"]] == 0


def test_no_data_gives_an_empty_batch_not_a_deadlock(db: Database) -> None:
    add_tasks(db, {"name": "a"})
    buf = make_buffer(db, batch_groups=4)
    batch = buf.claim_batch(0)
    assert batch.groups == () and not batch.replayed


def test_every_episode_ends_exactly_once(db: Database, engine: sa.Engine) -> None:
    add_tasks(
        db,
        {"name": "a", "max_staleness": 0, "group_size": 2},
        {"name": "b", "max_staleness": 1, "group_size": 2},
    )
    buf = make_buffer(db, batch_groups=3, max_attempts=2)
    w = buf.register_worker("r0").id
    for step in range(6):
        buf.seed()
        # Some episodes fail (released), some are generated one version behind.
        for i in range(20):
            c = buf.claim(w)
            if c is None:
                break
            if (c.lease.episode_id + step) % 7 == 0:
                buf.release(c.lease, "flaky tool")
            else:
                finish(buf, c, version=max(0, step - (i % 2)))
        batch = buf.claim_batch(step)
        if batch.groups:
            buf.commit_step(step)
        else:
            break
    states: Counter[str] = Counter()
    for _id, status, consumed in episode_end_states(engine):
        if status == "done":
            states["trained" if consumed is not None else "ready"] += 1
        else:
            states[status] += 1
    assert states["trained"] > 0 and states["expired"] > 0
    # Every expired episode has exactly one successor carrying its prompt.
    orphans = scalar(
        engine,
        "SELECT count(*) FROM episodes e WHERE e.status = 'expired' AND "
        "(SELECT count(*) FROM episodes n WHERE n.requeued_from = e.id) <> 1",
    )
    assert orphans == 0
    # No trajectory consumed twice, none consumed from a group that is not trained.
    assert (
        scalar(
            engine,
            "SELECT count(*) FROM (SELECT task_id, episode_id, sample_index FROM trajectories GROUP BY 1,2,3 HAVING count(*) > 1) d",
        )
        == 0
    )
    assert (
        scalar(
            engine,
            "SELECT count(*) FROM trajectories tr JOIN episodes e ON e.id = tr.episode_id "
            "WHERE tr.status = 'consumed' AND (e.consumed_step IS NULL OR e.consumed_step <> tr.claimed_step)",
        )
        == 0
    )
    # Trained groups are complete.
    assert (
        scalar(
            engine,
            "SELECT count(*) FROM episodes e WHERE e.consumed_step IS NOT NULL AND e.group_size <> "
            "(SELECT count(*) FROM trajectories tr WHERE tr.episode_id = e.id AND tr.status = 'consumed')",
        )
        == 0
    )


def test_retire_expires_untrained_groups_and_waits_for_the_trainer(
    db: Database, engine: sa.Engine
) -> None:
    from rollcall.orchestrator.services.tasks import retire_task

    ids = add_tasks(db, {"name": "a", "group_size": 1, "max_staleness": 3})
    buf = make_buffer(db, batch_groups=2)
    buf.seed()  # cap (3+1)*2 = 8 episodes
    w = buf.register_worker("r0").id
    drain_queue(buf, w, version=0)
    batch = buf.claim_batch(0)  # the trainer reserves 2 groups
    with db.transaction() as tx:
        change_status(tx, job_name="default", name="a", action="drain", actor="t")
    with pytest.raises(ConflictError, match="trainer holds 2 groups"), db.transaction() as tx:
        retire_task(tx, job_name="default", name="a", confirmed=True, actor="t")
    buf.commit_step(0)
    assert len(batch.groups) == 2
    with db.transaction() as tx:
        retire_task(tx, job_name="default", name="a", confirmed=True, actor="t")
    states = dict(rows(engine, "SELECT status::text, count(*) FROM episodes GROUP BY 1"))
    assert states == {"done": 2, "expired": 6}  # 2 trained, 6 finished but never trained
    assert scalar(engine, "SELECT expired_groups FROM tasks WHERE id = :t", t=ids["a"]) == 6
    payload = scalar(engine, "SELECT payload FROM events WHERE kind = 'task.retired'")
    assert payload["expired_groups"] == 6


def test_groups_read_ahead_serve_the_claim_unchanged(db: Database, engine: sa.Engine) -> None:
    add_tasks(db, {"name": "a", "group_size": 2, "max_staleness": 0, "max_inflight": 8})
    buf = make_buffer(db, batch_groups=2)
    buf.seed()  # admission cap: 2 groups
    w = buf.register_worker("r0")
    drain_queue(buf, w.id, version=0)
    assert buf.prefetch_groups(limit=1) == 1  # the oldest finished group
    assert buf.prefetch_groups(limit=2) == 1  # only the one not read yet
    assert buf.prefetch_groups(limit=2) == 0
    batch = buf.claim_batch(0)
    assert batch.prefetched_groups == 2 and batch.num_trajectories == 4
    # The same groups read by another process's buffer, straight from the database.
    fresh = make_buffer(db, batch_groups=2)
    again = fresh.claim_batch(0)  # the reserved batch, replayed
    assert again.replayed and again.prefetched_groups == 0
    for g, h in zip(batch.groups, again.groups, strict=True):
        assert g.episode_id == h.episode_id
        for t, u in zip(g.trajectories, h.trajectories, strict=True):
            assert t.sample_index == u.sample_index and t.reward == u.reward
            assert t.payload.same_as(u.payload)
    buf.commit_step(0)

    # A group read ahead that expires (too stale for the new version) is forgotten and
    # never trained on; the claim reads what it takes that was not read ahead.
    buf.seed()
    drain_queue(buf, w.id, version=0)  # behaviour version 0: stale at version 1
    assert buf.prefetch_groups(limit=4) == 2
    assert buf.expire_stale() == {"a": 2}
    assert buf.prefetch_groups(limit=4) == 0 and not buf._prefetched
    buf.seed()
    drain_queue(buf, w.id, version=1)
    batch = buf.claim_batch(1)
    assert batch.prefetched_groups == 0 and len(batch.groups) == 2
    assert {g.min_policy_version for g in batch.groups} == {1}


def _prompt_only(n_tokens: int = 12) -> TrajectoryPayload:
    """A sample whose prompt alone used up ``rollout.max_tokens``: zero turns, no generated
    token, so no policy version (the agent loop ends it at once with "token limit")."""
    return TrajectoryPayload.build(
        np.arange(n_tokens),
        np.zeros(n_tokens, dtype=np.uint8),
        np.zeros(n_tokens, dtype=np.float32),
        prompt_tokens=n_tokens,
        finished=True,
    )


def test_group_without_a_generated_token_ends_quarantined(db: Database, engine: sa.Engine) -> None:
    """A group whose samples have zero turns has no policy version (min_policy_version NULL):
    it can neither be trained nor expire. It must end quarantined, with an event saying why,
    and free its admission slot instead of counting as outstanding forever."""
    ids = add_tasks(db, {"name": "a", "group_size": 2, "max_staleness": 1})
    buf = make_buffer(db, batch_groups=2)
    seeded = buf.seed()["a"]
    w = buf.register_worker("r0")
    one, two = buf.claim(w.id), buf.claim(w.id)
    assert one is not None and two is not None
    for c in (one, two):  # one statement per sample (rollcall_write_sample)
        for s in c.samples:
            buf.commit(c.lease, s.sample_index, _prompt_only(), 0.0)
    stuck = [one.lease.episode_id, two.lease.episode_id]

    # the scheduled expiry pass and the trainer's claim (waiting for a full batch) end them
    buf.expire_stale()
    assert buf.claim_batch(0, min_groups=2).groups == ()
    got = rows(engine, "SELECT status::text, last_error FROM episodes WHERE id = ANY(:e)", e=stuck)
    assert [s for s, _ in got] == ["quarantined", "quarantined"]
    assert all("rollout.max_tokens" in (err or "") for _, err in got)
    assert scalar(engine, "SELECT quarantined_episodes FROM tasks WHERE id = :t", t=ids["a"]) == 2
    events = rows(
        engine,
        "SELECT message FROM events WHERE kind = 'episode.quarantined' ORDER BY id",
    )
    assert len(events) == 2 and all("rollout.max_tokens" in m for (m,) in events)
    assert "12 tokens" in events[0][0]
    # their samples are not left ready for a batch, and the invariants hold
    assert (
        scalar(
            engine,
            "SELECT count(*) FROM trajectories WHERE episode_id = ANY(:e) AND status <> 'expired'",
            e=stuck,
        )
        == 0
    )
    from rollcall.orchestrator.buffer.invariants import check_invariants

    assert check_invariants(db, 1).ok
    # the admission slots are free again: seeding tops the task up by the two groups
    assert buf.seed() == {"a": 2} and seeded >= 2


# --- dynamic sampling's extra claims (TrainerBuffer.extend_batch) -----------------------------


def rollout(buf: Buffers, worker: int, version: int, varied: Callable[[int], bool]) -> None:
    """Seed, then play every claimable episode: sample k of a group is rewarded k % 2 when
    ``varied(its prompt index)``, else 0 (rewards all equal)."""
    buf.seed()
    while (c := buf.claim(worker)) is not None:
        for s in c.samples:
            reward = float(s.sample_index % 2) if varied(c.prompt_index) else 0.0
            buf.commit(c.lease, s.sample_index, payload(version, seed=s.sample_index), reward)


def test_extra_claims_reserve_into_the_step_replay_with_it_and_are_fenced(
    db: Database, engine: sa.Engine
) -> None:
    from rollcall.orchestrator.buffer.invariants import check_invariants

    a = add_tasks(db, {"name": "a", "group_size": 2, "max_staleness": 1})["a"]
    buf = make_buffer(db, batch_groups=2)
    buf.driver_epoch = scalar(engine, "SELECT driver_epoch FROM jobs WHERE id = 1")
    w = buf.register_worker("r0").id
    rollout(buf, w, 0, lambda i: i % 2 == 1)  # admission: (1 + 1) x 2 = 4 groups
    with pytest.raises(ConflictError, match="no claimed batch"):
        buf.extend_batch(0, 1, have=[], degenerate={})
    first = buf.claim_batch(0, min_groups=2)
    held = [g.episode_id for g in first.groups]
    assert first.dynamic_claims == 0
    extra = buf.extend_batch(0, 1, have=held, degenerate={a: 1})
    assert len(extra.groups) == 1 and extra.dynamic_claims == 1
    entry = extra.task_mix[str(a)]
    assert (entry["groups"], entry["extra"], entry["degenerate"]) == (3, 1, 1)
    # reserved into the step: its samples claimed, the claim counted in the pending mix
    held += [g.episode_id for g in extra.groups]
    assert scalar(engine, "SELECT count(*) FROM episodes WHERE claimed_step = 0") == 3
    assert scalar(engine, "SELECT count(*) FROM trajectories WHERE status = 'claimed'") == 6
    # one finished group left: a claim of two reserves nothing and says what it lacks
    short = buf.extend_batch(0, 2, have=held, degenerate={a: 1})
    assert short.groups == () and short.shortfall == 1 and short.dynamic_claims == 1
    # the driver dies: a restarted one replays the whole step, its extra claim included
    buf.release_trainer_claims()
    again = make_buffer(db, batch_groups=2).claim_batch(0, min_groups=2)
    assert again.replayed and [g.episode_id for g in again.groups] == sorted(held)
    assert again.dynamic_claims == 1 and again.task_mix[str(a)]["groups"] == 3
    # an extra claim retried after its commit was lost gets the groups it lacks, no new claim
    lost = buf.extend_batch(0, 1, have=held[:2], degenerate={})
    assert [g.episode_id for g in lost.groups] == held[2:] and lost.dynamic_claims == 1
    # another driver takes the job over: this one can no longer reserve into the step
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE jobs SET driver_epoch = driver_epoch + 1 WHERE id = 1"))
    with pytest.raises(ConflictError, match="another driver"):
        buf.extend_batch(0, 1, have=held, degenerate={})
    assert scalar(engine, "SELECT count(*) FROM episodes WHERE claimed_step = 0") == 3
    buf.driver_epoch += 1
    commit = buf.commit_step(0)
    assert (commit.groups, commit.trajectories) == (3, 6)
    assert rows(engine, "SELECT task_mix FROM train_steps")[0][0]["dynamic_claims"] == 1
    assert check_invariants(db, 1).ok


def test_groups_a_step_will_not_train_do_not_hold_admission(db: Database) -> None:
    """In sync mode (staleness 0) a task's admission is its share of one batch: the groups its
    step holds without variance must not count, or rollout would never replace them."""
    a = add_tasks(db, {"name": "a", "group_size": 2, "max_staleness": 0})["a"]
    buf = make_buffer(db, batch_groups=2)
    w = buf.register_worker("r0").id
    rollout(buf, w, 0, lambda i: False)
    batch = buf.claim_batch(0, min_groups=2)
    assert buf.seed() == {}  # the step holds the task's whole admission
    held = [g.episode_id for g in batch.groups]
    short = buf.extend_batch(0, 2, have=held, degenerate={a: 2})
    assert short.groups == () and short.shortfall == 2
    assert buf.seed() == {"a": 2}
