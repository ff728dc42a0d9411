"""A smoke run of ``ops/bench/pipeline.py``'s harness: the real job driver, rollout node actors,
buffer and scheduler with the timing-model engine, trainer and ``longtail`` tasks, in async and
sync mode. It checks that the seams carry a whole job (every invariant holds afterwards) and
that the benchmark's figures are collected; it asserts no timings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ops.bench.pipeline import Setup, run_job
from rollcall.orchestrator.buffer.invariants import check_invariants
from rollcall.orchestrator.db.engine import Database
from tests.conftest import PgServer
from tests.integration.buffer_helpers import scalar


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_timing_model_job_runs_through_the_real_orchestrator(
    mode: str,
    ray_local: Any,
    pg: PgServer,
    db_url: str,
    db: Database,
    tiny_dir: Path,
    tmp_path: Path,
) -> None:
    setup = Setup(
        mode=mode, nodes=1, concurrency=4, tasks=2, batch_groups=2, group_size=2,
        max_staleness=3, scale=0.004, steps=3, warmup=1, trainer={"s_per_token": 1e-4},
    )  # fmt: skip
    r = run_job(setup, db_url, pg.home, tiny_dir, f"smoke-{mode}")
    assert r["steps"] == 3 and r["trained"] == 2 * 2 * 2  # steps 1 and 2, 2 groups of 2
    job_id = int(scalar(db.engine, "SELECT id FROM jobs WHERE name = :n", n=f"smoke-{mode}"))
    report = check_invariants(db, job_id)
    assert report.ok, report.summary()
    # staleness within the bound (0 in sync mode), the costs measured on nodes and driver
    bound = 0 if mode == "sync" else 3
    assert all(0 <= lag <= bound for lag in r["staleness"])
    ops = r["cp"]["ops"]
    assert ops["node.claim"]["calls"] >= 1 and ops["node.checkpoint"]["calls"] >= 1
    assert ops["driver.claim_batch"]["calls"] >= 1 and ops["driver.commit_step"]["calls"] == 2
    assert r["cp"]["pg_cpu_ms_per_traj"] > 0
    # the trainer's waits on claims and commits are part of the driver's database time, and
    # its modelled seconds part of the phases it was measured busy in
    assert 0 < r["cp"]["trainer_path_share"] <= r["cp"]["driver_share"]
    assert 0 < r["modelled_busy"] <= r["busy"]
    # the timing trainer published real files by version, the nodes loaded them
    assert scalar(db.engine, "SELECT weights_version FROM jobs WHERE id = :j", j=job_id) == 3
    loaded = scalar(
        db.engine, "SELECT max(loaded_version) FROM workers WHERE job_id = :j AND role = 'rollout'",
        j=job_id,
    )  # fmt: skip
    assert loaded is not None and loaded >= 1
