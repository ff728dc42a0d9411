"""``rollcall drill kill-node``'s view of a real multi-node Ray on this machine
(``ray.cluster_utils.Cluster``, a head and one worker node, next to whatever Ray the test
process has: the drill is no Ray driver either): the worker node's processes are its raylet
and what runs under it, never the head's, and Ray's own node table marks the node dead once
they are killed (the drill's ``ray_detection_s``). tests/unit/test_node_processes.py lays out
the ``ray start`` cases."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from rollcall.orchestrator import procfs
from rollcall.orchestrator.services.nodeloss import RayNodeWatch, find_ray_node, ray_node_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

# Ray's health checks as a test can wait for them (Ray 2.60's defaults: a node is dead after
# 5 failed checks, one every 3 s)
HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 300,
    "health_check_timeout_ms": 300,
    "health_check_failure_threshold": 3,
}


@pytest.fixture
def cluster() -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": HEALTH_CHECKS},
    )
    try:
        yield c
    finally:
        c.shutdown()


def _pids(node: Any) -> dict[str, list[int]]:
    """The processes a cluster_utils node started itself, by Ray's process type."""
    return {kind: [p.process.pid for p in infos] for kind, infos in node.all_processes.items()}


def test_a_worker_nodes_processes_and_rays_detection(cluster: Any) -> None:
    worker = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    head = cluster.head_node
    mine, theirs = _pids(worker), _pids(head)
    # cluster_utils starts one log monitor per machine, the head's; a worker node has its
    # raylet (the agents are the raylet's children) and its reaper (the test's child)
    assert "log_monitor" in theirs and "log_monitor" not in mine
    assert set(mine) <= {"raylet", "reaper"}

    node = find_ray_node(worker.node_id)
    procs = dict(node.processes)
    assert procs[mine["raylet"][0]] == "raylet"
    kinds = Counter(procs.values())
    assert kinds["raylet"] == 1 and kinds["agent"] == 2, node.processes  # dashboard, runtime env
    assert set(kinds) <= {"raylet", "agent", "worker"}, node.processes
    # nothing of the head: what it started, and what runs under its raylet
    head_node = find_ray_node(head.node_id)
    head_pids = {pid for pids in theirs.values() for pid in pids} | dict(head_node.processes).keys()
    assert not head_pids & procs.keys()
    # the head's log monitor names the session both nodes share: left alone, reported
    assert theirs["log_monitor"][0] in dict(node.shared)
    assert dict(head_node.processes)[theirs["gcs_server"][0]] == "gcs"  # refused by the drill
    assert mine["raylet"][0] not in dict(head_node.processes)
    assert node.gcs_address == cluster.gcs_address
    assert ray_node_processes(worker.node_id) == node.processes

    # the drill's kill: Ray's node table marks the node dead, the head lives on
    watch = RayNodeWatch(worker.node_id, node.gcs_address, node.cluster_id)
    t0 = time.monotonic()
    for pid in procs:
        os.kill(pid, signal.SIGKILL)
    watch.start(t0, t0 + 30)
    detected = watch.result()
    assert detected is not None and 0 < detected < 30, watch.why_not()
    assert not [p for p in procs if procfs.alive(p)]
    assert find_ray_node(worker.node_id).processes == []
    assert all(procfs.alive(p) for pids in theirs.values() for p in pids)
    print(f"{node.processes}; shared {node.shared}; Ray's detection {detected:.2f} s")
