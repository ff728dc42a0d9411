"""How a rollout node spreads work over its agent loops (in-process, real PostgreSQL, the
torch-free timing-model engine and ``longtail`` task):

- a group's samples run in parallel on the node's free loops;
- a node claims no more episodes than it can start (no hoarding while other nodes idle);
- an idle node claims about once per ``idle_sleep_s``, not once per loop;
- a claim carries the published weights, loaded before the rollout starts.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from rollcall.orchestrator.buffer.control import ControlPlaneBuffer
from rollcall.orchestrator.buffer.rollout import RolloutBuffer
from rollcall.orchestrator.config import BufferConfig, TimingEngineConfig
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.services.tasks import register_task
from rollcall.workers.episode.tools import ToolRunner
from rollcall.workers.episode.trajectory import Limits
from rollcall.workers.rollout.node import NodeConfig, RolloutNode
from tests.integration.buffer_helpers import rows, scalar

SCALE = 0.02  # real seconds per simulated second


def _task(db: Database, *, group_size: int, turns: int = 3) -> int:
    spec = {
        "group_size": group_size, "turns_min": turns, "turns_max": turns, "tool_median_s": 1.0,
        "tool_sigma": 0.0, "prompt_tokens_min": 50, "prompt_tokens_max": 50, "time_scale": SCALE,
    }  # fmt: skip
    with db.transaction() as tx:
        t = register_task(
            tx, job_name="default", name="lt", plugin="longtail", actor="test",
            max_inflight=100, max_staleness=100, spec_data=spec,
        )  # fmt: skip
    return t.id


def _node(db_url: str, tiny_dir: Path, concurrency: int, **kw: Any) -> RolloutNode:
    return RolloutNode(
        db_url,
        1,
        NodeConfig(
            name="r0",
            model_dir=str(tiny_dir),
            concurrency=concurrency,
            heartbeat_interval_s=60,
            limits=Limits(max_tokens_per_turn=512, max_tokens=12_000),
            engine=TimingEngineConfig(time_scale=SCALE),
            **kw,
        ),
        BufferConfig(batch_groups=1),
    )


def test_a_groups_samples_run_in_parallel_and_the_node_does_not_hoard(
    tiny_dir: Path, db: Database, db_url: str, engine: sa.Engine
) -> None:
    _task(db, group_size=4)
    with db.transaction() as tx:  # three groups queued at once
        tx.episodes.add_episodes(
            job_id=1, task_id=1, first_index=0, prompts=[{"index": i, "key": i} for i in range(3)],
            group_size=4,
        )  # fmt: skip
    node = _node(db_url, tiny_dir, concurrency=4)
    leased: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            leased.append(scalar(engine, "SELECT count(*) FROM episodes WHERE status = 'leased'"))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        report = node.run(max_episodes=3)
    finally:
        done.set()
        watcher.join()
        node.stop()
    assert report["episodes_committed"] == 3 and report["samples_committed"] == 12
    # the four samples of a group generate at once on the four loops ...
    assert node.host.base.peak_in_flight == 4  # type: ignore[attr-defined]
    # ... and the node holds one group at a time (two while the next one starts), where one
    # loop per episode would have leased all three at once
    assert max(leased) <= 2
    assert rows(engine, "SELECT DISTINCT status::text FROM episodes") == [("done",)]


def test_an_idle_node_claims_once_per_idle_sleep_not_once_per_loop(
    tiny_dir: Path, db: Database, db_url: str
) -> None:
    _task(db, group_size=2)  # nothing seeded: every claim finds no work
    node = _node(db_url, tiny_dir, concurrency=8, idle_sleep_s=0.1)
    t0 = time.monotonic()
    node.run(until_idle_s=1.0)
    took = time.monotonic() - t0
    node.stop()
    claims = node.buffer.timings.snapshot()["claim"]["calls"]
    # one claim per 0.1 s for the whole node (8 loops polling alone: about 8 x 10 per second)
    assert claims <= took / 0.1 + 3


def test_a_claim_carries_the_published_weights_loaded_before_the_rollout(
    tiny_dir: Path, db: Database, db_url: str, engine: sa.Engine, tmp_path: Path
) -> None:
    _task(db, group_size=1, turns=2)
    ControlPlaneBuffer(db, 1, BufferConfig(batch_groups=1)).seed()
    buf = RolloutBuffer(db, 1, BufferConfig(batch_groups=1))
    node = _node(db_url, tiny_dir, concurrency=1)
    assert node.version() == 0
    # a version is published after the node started (and its heartbeat is far away)
    weights = tmp_path / "v000003"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"w")
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE jobs SET weights_version = 3, weights_uri = :u WHERE id = 1"),
            {"u": str(weights)},
        )
    claim = buf.claim(buf.register_worker("probe").id)
    assert claim is not None and claim.published_weights == (3, str(weights))
    buf.release(claim.lease, "probe")  # back to the queue for the node
    report = node.run(max_episodes=1)
    node.stop()
    assert report["samples_committed"] == 1 and report["version"] == 3
    versions = rows(engine, "SELECT turn_versions FROM trajectories")
    assert versions == [([3, 3],)]  # every turn generated by the published version


def test_an_episode_admitted_during_a_heartbeat_is_not_taken_for_lost(
    tiny_dir: Path, db: Database, db_url: str, engine: sa.Engine
) -> None:
    """The heartbeat returns the leases the database held when it ran; an episode the node
    claimed and admitted while the beat was in flight is missing from that list but is not
    lost. (Marking it lost made the node drop the episode at its first turn while still
    holding and renewing the lease: a sync job waited for that group forever.)"""
    _task(db, group_size=2)
    ControlPlaneBuffer(db, 1, BufferConfig(batch_groups=1)).seed()
    node = _node(db_url, tiny_dir, concurrency=2)
    beat = node.buffer.beat
    admitted: list[tuple[int, int]] = []

    def beat_then_admit(*args: Any, **kw: Any) -> Any:
        result = beat(*args, **kw)  # the leases as of now: none
        claim = node.buffer.claim(node.worker.id)  # a loop claims meanwhile
        assert claim is not None
        node.scheduler.admit(claim)
        admitted.append((claim.lease.episode_id, claim.lease.epoch))
        return result

    node.buffer.beat = beat_then_admit  # type: ignore[method-assign]
    node.heartbeat.beat()
    node.buffer.beat = beat  # type: ignore[method-assign]
    assert admitted and node.leases.works_on(admitted[0])
    assert not node.leases.is_lost(admitted[0])
    node.heartbeat.beat()  # the next beat sees the lease: still not lost
    assert not node.leases.is_lost(admitted[0])
    node.stop()


def test_an_episode_dropped_as_lost_while_still_held_goes_back_to_the_queue(
    tiny_dir: Path, db: Database, db_url: str, engine: sa.Engine
) -> None:
    _task(db, group_size=1)
    ControlPlaneBuffer(db, 1, BufferConfig(batch_groups=1)).seed()
    node = _node(db_url, tiny_dir, concurrency=1)
    claim = node.buffer.claim(node.worker.id)
    assert claim is not None
    job = node.scheduler.admit(claim)
    assert job is not None
    node.leases.lose((claim.lease.episode_id, claim.lease.epoch))  # wrongly taken for lost
    runner = ToolRunner(timeout_s=5)
    try:
        # the first turn's checkpoint gives the episode up
        node.scheduler.run_sample(*job, runner)
    finally:
        runner.close()
    node.stop()
    status = scalar(
        engine, "SELECT status::text FROM episodes WHERE id = :e", e=claim.lease.episode_id
    )
    assert status == "queued"  # released, not left leased to a live node that renews it
