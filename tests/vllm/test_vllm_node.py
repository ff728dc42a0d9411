"""A rollout node hosting real vLLM (CPU build) in a Ray actor, on real PostgreSQL: weights that
fail to load inside vLLM generate and commit nothing until a later version loads; an EngineCore
SIGKILLed mid-generation ends the node at once with every lease given back (not counted as an
attempt); killing the actor leaves no vLLM process behind. One engine start for the module."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from rollcall.orchestrator.buffer.control import ControlPlaneBuffer
from rollcall.orchestrator.config import BufferConfig, VLLMEngineConfig
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.engineprocs import engine_processes
from rollcall.orchestrator.procfs import alive
from rollcall.workers.episode.trajectory import Limits
from rollcall.workers.rollout.node import NodeConfig, rollout_actor
from tests.integration.buffer_helpers import rows, scalar
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(600)


def _publish(engine: sa.Engine, version: int, location: str) -> None:
    """What a step commit does to the job's published weights (no trainer here)."""
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE jobs SET weights_version = :v, weights_uri = :u WHERE id = 1"),
            {"v": version, "u": location},
        )


def _versions(engine: sa.Engine) -> set[int]:
    return {v for (vs,) in rows(engine, "SELECT turn_versions FROM trajectories") for v in vs or []}


def test_a_vllm_node_survives_a_failed_load_and_gives_back_a_dead_engines_leases(
    ray_local: Any, vllm_tiny_dir: Path, db: Database, db_url: str, engine: sa.Engine,
    tmp_path: Path,
) -> None:  # fmt: skip
    from rollcall.orchestrator.services.tasks import register_task
    from rollcall.workers.weights import publish

    with db.transaction() as tx:
        register_task(
            tx, job_name="default", name="calc", plugin="calculator", actor="test",
            max_staleness=50, max_inflight=4, spec_data={"group_size": 2, "max_turns": 3},
        )  # fmt: skip
    buffer = BufferConfig(batch_groups=2)
    ControlPlaneBuffer(db, 1, buffer).seed()
    node = rollout_actor(num_cpus=1).remote(
        db_url,
        1,
        NodeConfig(
            name="rollout-0",
            model_dir=str(vllm_tiny_dir),
            concurrency=2,
            heartbeat_interval_s=0.5,
            limits=Limits(max_tokens_per_turn=16, max_tokens=512),
            engine=VLLMEngineConfig(device="cpu", dtype="float32"),
        ),
        buffer,
    )
    run = node.run.remote()
    ready = "SELECT count(*) FROM trajectories WHERE status = 'ready'"
    wait_for("first commits", lambda: scalar(engine, ready) >= 2, 240)
    actor_pid = int(scalar(engine, "SELECT pid FROM workers"))
    recorded = scalar(engine, "SELECT info->'engine_processes' FROM workers")
    core = int(recorded["engine_core"])
    mine = {core, *recorded["engine_workers"]}
    assert all(alive(p) for p in mine), (recorded, engine_processes(actor_pid))

    # 1. a corrupt version: vLLM refuses it, the node serves nothing and claims nothing
    corrupt = tmp_path / "weights" / "v000001"
    corrupt.mkdir(parents=True)
    (corrupt / "model.safetensors").write_bytes(b"\0" * 4096)
    _publish(engine, 1, str(corrupt))
    wait_for("the failed load", lambda: ray_local.get(node.report.remote())["weights_error"], 60)
    leased = "SELECT count(*) FROM episodes WHERE status = 'leased'"
    wait_for("its episodes given back", lambda: scalar(engine, leased) == 0, 60)
    committed = scalar(engine, ready)
    time.sleep(3)  # several heartbeats and claim rounds: still nothing claimed or committed
    assert scalar(engine, leased) == 0 and scalar(engine, ready) == committed
    assert 1 not in _versions(engine)
    assert scalar(engine, "SELECT count(*) FROM episodes WHERE status = 'quarantined'") == 0

    # 2. the next version loads: the node goes on under it
    from safetensors.torch import load_file

    state = load_file(str(vllm_tiny_dir / "model.safetensors"))
    state.pop("lm_head.weight", None)
    _publish(engine, 2, publish(state, tmp_path / "weights", 2))
    wait_for("turns under version 2", lambda: 2 in _versions(engine), 120)
    report = ray_local.get(node.report.remote())
    assert report["version"] == 2 and report["weights_error"] is None

    # 3. the EngineCore SIGKILLed mid-generation: every lease given back at once, uncounted
    held = f"SELECT id, attempts FROM episodes WHERE status = 'leased' AND lease_owner = {report['worker_id']}"
    # the rows that were seen (a second query could find them finished: an empty list)
    attempts = dict(wait_for("episodes in flight", lambda: rows(engine, held), 60))
    t0 = time.monotonic()
    os.kill(core, signal.SIGKILL)
    with pytest.raises(Exception, match="EngineFailure"):
        ray_local.get(run, timeout=60)
    took = time.monotonic() - t0
    assert took < 30, took
    assert scalar(engine, "SELECT status::text FROM workers") == "dead"
    assert scalar(engine, leased) == 0
    after = {
        e: (n, status)
        for e, n, status in rows(
            engine,
            "SELECT id, attempts, status::text FROM episodes "
            f"WHERE id = ANY(ARRAY{sorted(attempts)})",
        )
    }
    # every episode the death caught is back in the queue, its attempt not counted (one that
    # finished between the query above and the kill is done, with its attempt)
    given_back = {e for e, (_, status) in after.items() if status != "done"}
    assert all(after[e] == (attempts[e] - 1, "queued") for e in given_back), (attempts, after)
    assert scalar(engine, "SELECT count(*) FROM events WHERE kind = 'worker.engine_failed'") == 1
    assert scalar(engine, "SELECT count(*) FROM episodes WHERE status = 'quarantined'") == 0

    # 4. the actor SIGKILLed: no vLLM process of it is left
    os.kill(actor_pid, signal.SIGKILL)
    wait_for("no vLLM process left", lambda: not any(alive(p) for p in mine), 30)
