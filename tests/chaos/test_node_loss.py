"""Losing a whole Ray node: a two-node cluster on one machine (``ray.cluster_utils.Cluster``)
whose second node hosts the rollout nodes; the node is killed mid-run by the kill-node drill,
the supervisor restarts the rollout nodes on a spare node, and nothing is lost.

The long tier (``pytest -m long``): every push drills kill-node in the job of
tests/chaos/test_elastic_fleet.py (the timing-model engine; here the tiny model's hf nodes,
two of them on the lost node)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from rollcall.orchestrator.buffer.invariants import check_invariants
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.services.drills import Drills
from tests.chaos.test_faults import _config, _driver
from tests.integration.buffer_helpers import rows, scalar
from tests.support.cluster import ray_cluster
from tests.support.waiting import wait_for

# This test was opt-in while it failed in about half of its runs. In the failures reproduced
# (2 of 5 runs of its 10-step version) the recovery had worked: the job trained its last steps
# from the buffer and ended, stopping its rollout nodes, within seconds of their new
# incarnations registering, so the drill, which waited for both to hold the then-current
# version at once, never saw it and sat out its 180 s with recovery None (a stack dump then:
# no job thread left, the test's main thread in the drill's recovery wait). Now the job runs
# until the drill has reported, plus one step, and the drill measures recovery against the
# version published at the fault. A driver blocked in a trainer call, seen once before, did
# not recur in 39 runs; trainer calls time out now and supervision has its own thread anyway.
# Since: 20 passes in 20 runs on a loaded 2-core machine, 47-78 s each (detection 1.4-2.5 s,
# recovery 8-13 s).
pytestmark = [pytest.mark.timeout(600), pytest.mark.long]

STEPS = "SELECT count(*) FROM train_steps"


@pytest.fixture
def cluster(ray_local: Any) -> Iterator[Any]:
    """Swap the session's local Ray for a two-node cluster, and back afterwards."""
    # the head hosts the driver's actors and the trainer ({"trainer": ...}); rollout nodes need
    # {"rollout": 1}, which only the worker nodes added by the test have
    with ray_cluster(num_cpus=4, resources={"trainer": 2}) as c:
        yield c


def test_losing_the_ray_node_of_the_rollout_nodes(
    cluster: Any, tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    """``rollcall drill kill-node`` on the node that hosts both rollout nodes, with a spare
    node in the cluster: every process of the node is SIGKILLed, both rollout nodes are
    declared dead, restarted on the spare node, the job trains on, and nothing is lost or
    trained twice."""
    worker_node = cluster.add_node(num_cpus=2, resources={"rollout": 2})
    cluster.wait_for_nodes()
    # total_steps is a ceiling: the job is stopped once the drill has reported
    cfg = _config(tmp_path, tiny_dir, steps=1000, resources={"rollout": 1}, start_timeout_s=60.0)
    cfg = cfg.model_copy(
        update={"trainer": cfg.trainer.model_copy(update={"resources": {"trainer": 1}})}
    )
    driver = _driver(cfg, db, tiny_dir, tmp_path)
    outcome: dict[str, Any] = {}

    def run() -> None:  # the job in a thread: Ray's cluster_utils adds nodes from the main one
        try:
            outcome["result"] = driver.run()
        except BaseException as e:
            outcome["error"] = e

    t = threading.Thread(target=run, daemon=True)
    try:
        driver.setup()
        t.start()
        wait_for("a first step", lambda: scalar(engine, STEPS))
        alive = "SELECT name, node_id FROM workers WHERE role = 'rollout' AND status = 'alive'"
        wait_for("both rollout nodes alive", lambda: len(rows(engine, alive)) == 2)
        before = rows(engine, alive)
        assert {n for _, n in before} == {worker_node.node_id}  # both on the worker node
        spare = cluster.add_node(num_cpus=2, resources={"rollout": 2})
        report = Drills(db, "chaos", timeout_s=180).kill_node(worker_node.node_id)
        print(json.dumps(report.to_json()))  # the figures, with -s
        assert report.passed, f"{report.to_json()}\n{_timeline(engine)}"
        # the raylet and everything under it: the agents and the worker processes
        assert "1 raylet" in report.notes[0] and "2 agent" in report.notes[0], report.notes
        recovered_at = scalar(engine, STEPS)
        wait_for("a step after the recovery", lambda: scalar(engine, STEPS) > recovered_at, 60)
    finally:
        driver.request_stop()  # finish after the current step
        t.join(timeout=120)
        stuck = t.is_alive()
        driver.close()
    assert not stuck, f"the job did not stop after the node loss\n{_timeline(engine)}"
    assert "error" not in outcome, f"{outcome}\n{_timeline(engine)}"
    assert report.lost == 0 and report.duplicated == 0
    assert report.detection_s is not None and report.recovery_s is not None
    assert all(name in report.target for name, _ in before)
    assert outcome["result"].steps > recovered_at
    # the restarted incarnations ran on the spare node
    moved = rows(
        engine,
        "SELECT DISTINCT name FROM workers WHERE role = 'rollout' AND node_id = :n",
        n=spare.node_id,
    )
    assert {m for (m,) in moved} == {"rollout-0", "rollout-1"}
    # the trainer, on the head node, went through the node loss undisturbed
    kinds = [k for (k,) in rows(engine, "SELECT kind FROM events")]
    assert "trainer.restarted" not in kinds, _timeline(engine)
    job = scalar(engine, "SELECT id FROM jobs WHERE name = 'chaos'")
    invariants = check_invariants(db, job)
    assert invariants.ok, invariants.summary()


def _timeline(engine: sa.Engine) -> str:
    """Worker incarnations, events and step commits, for a failure message."""
    workers = rows(
        engine,
        "SELECT id, name, status, left(node_id, 8), loaded_version, started_at::time, "
        "last_heartbeat_at::time, stopped_at::time FROM workers ORDER BY id",
    )
    events = rows(engine, "SELECT created_at::time, kind, message FROM events ORDER BY id")
    steps = rows(engine, "SELECT step, created_at::time FROM train_steps ORDER BY step")
    return "\n".join(
        [f"worker {r}" for r in workers]
        + [f"event {r}" for r in events]
        + [f"step {r}" for r in steps]
    )
