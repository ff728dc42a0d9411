"""Losing a whole Ray node: a two-node cluster on one machine (``ray.cluster_utils.Cluster``)
whose second node hosts the rollout nodes; the node is killed mid-run by the kill-node drill,
the supervisor restarts the rollout nodes on a spare node, and nothing is lost."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator.buffer.invariants import check_invariants
from orchestrator.db.engine import Database
from orchestrator.services.drills import Drills
from tests.chaos.test_faults import _config, _driver, _wait
from tests.conftest import init_local_ray
from tests.integration.buffer_helpers import rows, scalar

# Opt-in: it passed in 2 of 4 runs on a 2-core machine. In the failures the job's driver
# sat in a trainer call (save_checkpoint) after the worker node's raylet was SIGKILLed, so the
# supervisor never got to place the restarted nodes; the cause is not found yet.
pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        os.environ.get("ROLLCALL_NODE_LOSS_TEST") != "1",
        reason="flaky on small machines; run with ROLLCALL_NODE_LOSS_TEST=1",
    ),
]


@pytest.fixture
def cluster(ray_local: Any) -> Iterator[Any]:
    """Swap the session's local Ray for a two-node cluster, and back afterwards."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    # the head hosts the driver's actors and the trainer ({"trainer": ...}); rollout nodes need
    # {"rollout": 1}, which only the worker nodes added by the test have
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "resources": {"trainer": 2}})
    try:
        ray.init(address=c.address, log_to_driver=False, configure_logging=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        os.environ.pop("RAY_ADDRESS", None)
        init_local_ray()


def test_losing_the_ray_node_of_the_rollout_nodes(
    cluster: Any, tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    """``rollcall drill kill-node`` on the node that hosts both rollout nodes, with a spare
    node in the cluster: every process of the node is SIGKILLed, both rollout nodes are
    declared dead, restarted on the spare node, and nothing is lost or trained twice."""
    worker_node = cluster.add_node(num_cpus=2, resources={"rollout": 2})
    cluster.wait_for_nodes()
    cfg = _config(tmp_path, tiny_dir, steps=10, resources={"rollout": 1}, start_timeout_s=60.0)
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
        _wait("a first step", lambda: scalar(engine, "SELECT count(*) FROM train_steps"))
        alive = "SELECT name, node_id FROM workers WHERE role = 'rollout' AND status = 'alive'"
        _wait("both rollout nodes alive", lambda: len(rows(engine, alive)) == 2)
        before = rows(engine, alive)
        assert {n for _, n in before} == {worker_node.node_id}  # both on the worker node
        spare = cluster.add_node(num_cpus=2, resources={"rollout": 2})
        report = Drills(db, "chaos", timeout_s=180).kill_node(worker_node.node_id)
        t.join(timeout=300)
        assert not t.is_alive(), "the job did not finish after the node loss"
    finally:
        if t.is_alive():
            driver.request_stop()
            t.join(timeout=60)
        driver.close()
    assert "error" not in outcome, outcome
    result = outcome["result"]
    print(json.dumps(report.to_json()))  # the figures, with -s
    assert report.passed, report.to_json()
    assert report.lost == 0 and report.duplicated == 0
    assert report.detection_s is not None and report.recovery_s is not None
    assert all(name in report.target for name, _ in before)
    assert result.steps == 10
    # the restarted incarnations ran on the spare node
    moved = rows(
        engine,
        "SELECT DISTINCT name FROM workers WHERE role = 'rollout' AND node_id = :n",
        n=spare.node_id,
    )
    assert {m for (m,) in moved} == {"rollout-0", "rollout-1"}
    job = scalar(engine, "SELECT id FROM jobs WHERE name = 'chaos'")
    invariants = check_invariants(db, job)
    assert invariants.ok, invariants.summary()
