"""A rollout node on real Ray and real PostgreSQL completes claimed episodes for two tasks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from rollcall.orchestrator.config import BufferConfig
from rollcall.orchestrator.db.engine import Database
from rollcall.workers.episode.trajectory import Limits
from rollcall.workers.rollout.node import NodeConfig, RolloutNode, rollout_actor
from tests.integration.buffer_helpers import add_tasks, rows, scalar
from tests.support.waiting import wait_for


def _register(db: Database) -> dict[str, int]:
    from rollcall.orchestrator.services.tasks import register_task

    ids = add_tasks(db, {"name": "echo", "group_size": 2, "max_staleness": 4})
    with db.transaction() as tx:
        t = register_task(
            tx,
            job_name="default",
            name="calc",
            plugin="calculator",
            actor="test",
            max_staleness=4,
            spec_data={"group_size": 2, "max_turns": 2},
        )
        ids["calc"] = t.id
    return ids


def test_rollout_node_actor_completes_episodes_for_two_tasks(
    ray_local: Any, tiny_dir: Path, db: Database, db_url: str, engine: sa.Engine
) -> None:
    ids = _register(db)
    buffer = BufferConfig(batch_groups=2)
    from rollcall.orchestrator.buffer.control import ControlPlaneBuffer

    ControlPlaneBuffer(db, 1, buffer).seed()
    node = rollout_actor(num_cpus=1).remote(
        db_url,
        1,
        NodeConfig(
            name="rollout-0",
            model_dir=str(tiny_dir),
            concurrency=2,
            heartbeat_interval_s=0.5,
            limits=Limits(max_tokens_per_turn=12, max_tokens=512),
        ),
        buffer,
    )
    report = ray_local.get(node.run.remote(max_episodes=6), timeout=300)
    assert report["episodes_committed"] == 6 and report["samples_committed"] == 12
    assert report["tokens_generated"] > 0 and report["turns"] >= 12

    done = dict(
        rows(engine, "SELECT task_id, count(*) FROM episodes WHERE status = 'done' GROUP BY 1")
    )
    assert set(done) == {ids["echo"], ids["calc"]} and sum(done.values()) == 6
    trajs = rows(
        engine,
        "SELECT task_id, num_tokens, prompt_tokens, num_turns, turn_versions, reward, reward_info "
        "FROM trajectories WHERE status = 'ready'",
    )
    assert len(trajs) == 12
    for task_id, n, prompt_n, turns, versions, reward, info in trajs:
        assert n > prompt_n > 0 and turns >= 1 and versions == [0] * turns
        assert reward is not None and info["turns"] == turns
        if task_id == ids["calc"]:
            assert turns <= 2
    w = rows(engine, "SELECT status::text, tokens_generated, pid FROM workers")
    assert w[0][0] == "alive" and w[0][1] > 0 and w[0][2] != os.getpid()
    assert scalar(engine, "SELECT count(*) FROM episodes WHERE status = 'leased'") == 0


def test_node_abandons_an_episode_whose_lease_moved_on(
    tiny_dir: Path, db: Database, db_url: str, engine: sa.Engine
) -> None:
    """In-process (no Ray): the node's lease is requeued while it works; its writes are
    rejected, it abandons the episode, and the next claimer resumes it."""
    add_tasks(db, {"name": "echo", "group_size": 1, "max_staleness": 0})
    buffer = BufferConfig(batch_groups=1)
    from tests.integration.buffer_helpers import Buffers

    buf = Buffers(db, buffer)
    buf.seed()
    node = RolloutNode(
        db_url,
        1,
        NodeConfig(name="r0", model_dir=str(tiny_dir), concurrency=1, heartbeat_interval_s=60),
        buffer,
    )
    claim = node.buffer.claim(node.worker.id)
    assert claim is not None
    buf.requeue_worker(node.worker.id)  # declared dead while it holds the lease
    from rollcall.workers.episode.tools import ToolRunner

    with ToolRunner() as runner:  # what an agent loop does with its claim
        job = node.scheduler.admit(claim)
        assert job is not None
        node.scheduler.run_sample(*job, runner)  # its only sample: the lease moved on
    stats = node.counters.stats
    assert stats.episodes_abandoned == 1 and stats.samples_committed == 0
    assert (
        scalar(engine, "SELECT status::text FROM episodes WHERE id = :e", e=claim.lease.episode_id)
        == "queued"
    )
    assert scalar(engine, "SELECT fenced_rejections FROM tasks") >= 1
    node.stop()


def test_a_lease_the_node_does_not_work_on_is_given_back_not_renewed(
    tiny_dir: Path, db: Database, db_url: str, engine: sa.Engine
) -> None:
    """In-process: a claim whose answer was lost after the database committed it leaves a lease
    the node holds but knows nothing of. Its beats must not renew it for the node's whole life:
    within a few beats it is given back, not counted as an attempt."""
    from tests.integration.buffer_helpers import Buffers

    add_tasks(db, {"name": "echo", "group_size": 1, "max_staleness": 0})
    buffer = BufferConfig(batch_groups=1)
    buf = Buffers(db, buffer)
    buf.seed()
    node = RolloutNode(
        db_url,
        1,
        NodeConfig(name="r0", model_dir=str(tiny_dir), concurrency=1, heartbeat_interval_s=0.3),
        buffer,
    )
    try:
        claim = buf.claim(node.worker.id)  # committed for the node; the node never heard of it
        assert claim is not None
        e = claim.lease.episode_id
        sql = "SELECT status::text, attempts FROM episodes WHERE id = :e"
        wait_for("the orphan lease given back", lambda: rows(engine, sql, e=e)[0][0] == "queued")
        assert rows(engine, sql, e=e)[0] == ("queued", 0)  # not counted
        assert node.leases.orphans_released == 1
    finally:
        node.stop()


def test_an_agent_loop_that_dies_gives_its_episode_back(
    tiny_dir: Path, db: Database, db_url: str, engine: sa.Engine
) -> None:
    """In-process: an agent thread that dies holding an episode (an exception no handler
    catches) does not leave its lease renewed by the node's beats: it is given back."""
    from rollcall.orchestrator.buffer.control import ControlPlaneBuffer

    add_tasks(db, {"name": "echo", "group_size": 1, "max_staleness": 0})
    buffer = BufferConfig(batch_groups=1)
    ControlPlaneBuffer(db, 1, buffer).seed()
    node = RolloutNode(
        db_url,
        1,
        NodeConfig(
            name="r0",
            model_dir=str(tiny_dir),
            concurrency=1,
            heartbeat_interval_s=0.3,
            engine_hook="tests.support.faults:deadly",
        ),
        buffer,
    )
    try:
        node.run(max_episodes=1)  # its only loop dies on its first generate call
        e = scalar(engine, "SELECT min(id) FROM episodes")
        sql = "SELECT status::text, attempts FROM episodes WHERE id = :e"
        wait_for("the episode given back", lambda: rows(engine, sql, e=e)[0][0] == "queued", 20)
        assert rows(engine, sql, e=e)[0] == ("queued", 0)
        assert scalar(engine, "SELECT count(*) FROM episodes WHERE status = 'leased'") == 0
    finally:
        node.stop()


def test_stop_on_a_node_that_is_not_running_ends_its_beats(
    tiny_dir: Path, db: Database, db_url: str, engine: sa.Engine
) -> None:
    """In-process: ``stop()`` on a node whose ``run`` ended on its own (``max_episodes``), or
    that never ran, ends its heartbeat and upkeep threads. They kept beating for the process's
    life: a test's node was seen beating against its dropped database from a later test."""
    config = NodeConfig(name="r0", model_dir=str(tiny_dir), concurrency=1, heartbeat_interval_s=0.3)
    ran, idle = (RolloutNode(db_url, 1, config, BufferConfig()) for _ in range(2))
    try:
        ran.run(max_episodes=0)  # nothing to do: returns, and the node beats on (still up)
        assert ran.heartbeat.thread.is_alive() and ran.upkeep.thread.is_alive()
        for node in (ran, idle):
            node.stop()

        def ended() -> bool:
            return not any(
                t.is_alive() for n in (ran, idle) for t in (n.heartbeat.thread, n.upkeep.thread)
            )

        wait_for("the stopped nodes' beats ended", ended, timeout_s=30)
    finally:
        for node in (ran, idle):
            node._beats_stop.set()


def test_a_drained_node_keeps_every_turn_its_samples_generated(
    tiny_dir: Path, db: Database, db_url: str, engine: sa.Engine
) -> None:
    """``drain()`` while all four samples of an episode are mid-rollout: each stops at its next
    turn boundary with that turn checkpointed (or committed), and the lease goes back only
    once none runs. The first sample to stop used to give the lease back at once: the others'
    turns in flight then found it gone and were dropped (generated, never stored)."""
    import threading

    from ops.bench.pipeline import Setup
    from rollcall.orchestrator.buffer.control import ControlPlaneBuffer
    from rollcall.orchestrator.services.tasks import register_task

    setup = Setup(nodes=1, concurrency=4, tasks=1, group_size=4, scale=0.01)
    (_, spec), *_ = setup.task_specs()
    with db.transaction() as tx:
        register_task(
            tx, job_name="default", name="long", plugin="longtail", actor="test",
            max_inflight=1, max_staleness=4, spec_data=spec,
        )  # fmt: skip
    ControlPlaneBuffer(db, 1, BufferConfig()).seed()
    node = RolloutNode(
        db_url,
        1,
        NodeConfig(
            name="r0",
            model_dir=str(tiny_dir),
            concurrency=4,
            heartbeat_interval_s=0.5,
            engine=setup.engine_config(),
            limits=Limits(max_tokens_per_turn=512, max_tokens=12_000),
        ),
        BufferConfig(),
    )
    report: dict[str, Any] = {}
    run = threading.Thread(target=lambda: report.update(node.run()), daemon=True)
    run.start()
    turns = "SELECT count(*) FROM trajectories WHERE num_turns >= 2"
    wait_for("samples two turns in", lambda: scalar(engine, turns) >= 2, 120)
    node.drain()
    run.join(timeout=120)
    assert not run.is_alive()
    stored = scalar(engine, "SELECT coalesce(sum(num_turns), 0) FROM trajectories")
    # every turn the node's loops finished is in PostgreSQL
    assert stored == node.counters.stats.turns, (stored, node.counters.stats)
    assert report["episodes_handed_back"] >= 1 and report["episodes_abandoned"] == 0
    # given back, not counted: the episode is queued again with its attempts unchanged
    status, attempts = rows(engine, "SELECT status::text, attempts FROM episodes")[0]
    assert status == "queued" and attempts == 0, (status, attempts)
