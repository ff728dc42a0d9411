"""After each step the driver asks the rollout nodes for their reports (weight-load latency,
versions held, tokens generated: ``JobDriver._node_metrics``). A node whose process is frozen
(SIGSTOP) never answers. It used to hold up every step's bookkeeping for the whole 10-s wait,
and leave every step without figures, until it was declared dead: in the chaos run where a
frozen node was never declared dead, the job made one step per 10 s for three minutes. Now
the step's figures come from the nodes that answered, and a node that still owes the last
step's report is not waited for again.

Real Ray, real rollout nodes (the tiny model) under the real supervisor, a real SIGSTOP."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from rollcall.orchestrator.buffer.control import ControlPlaneBuffer
from rollcall.orchestrator.config import BufferConfig
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.runner.nodes import NODE_REPORT_WAIT_S
from rollcall.orchestrator.runner.supervisor import Supervisor
from rollcall.workers.rollout.node import NodeConfig, rollout_actor
from tests.chaos.test_faults import _config, _driver
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(300)


def test_a_frozen_node_holds_up_one_steps_reports_and_no_others(
    ray_local: Any, tiny_dir: Path, db: Database, db_url: str, tmp_path: Path
) -> None:
    buffer = ControlPlaneBuffer(db, 1, BufferConfig())

    def start(index: int) -> Any:
        config = NodeConfig(name=f"rollout-{index}", model_dir=str(tiny_dir), concurrency=1)
        return rollout_actor(num_cpus=1).remote(db_url, 1, config, BufferConfig())

    supervisor = Supervisor(buffer, start, nodes=2, max_restarts=0)
    frozen = None
    try:

        def up() -> bool:
            supervisor.check()
            return len(supervisor.book.actors) == 2

        wait_for("both nodes up", up)
        driver = _driver(_config(tmp_path, tiny_dir, steps=1), db, tiny_dir, tmp_path)
        driver.supervisor = supervisor
        keys = {"weight_load_s_max", "node_versions_min", "tokens_generated"}
        # both answered
        assert set(driver._node_metrics()) == keys and not driver.node_reports.unanswered

        pids = {w["name"]: int(w["pid"]) for w in buffer.node_health()}
        frozen = pids["rollout-1"]
        os.kill(frozen, signal.SIGSTOP)
        # the step after the freeze: waits for the frozen node, and has the other's figures
        first = driver._node_metrics()
        assert set(first) == keys and len(driver.node_reports.unanswered) == 1
        # the next steps: the frozen node still owes its report and is not waited for again
        t0 = time.monotonic()
        for _ in range(3):
            assert set(driver._node_metrics()) == keys
        waited = time.monotonic() - t0
        assert waited < 3 * NODE_REPORT_WAIT_S / 2, f"waited for the frozen node again ({waited} s)"
        # once it answers (thawed), it is asked again
        os.kill(frozen, signal.SIGCONT)
        frozen = None
        wait_for(
            "the thawed node answering",
            lambda: driver._node_metrics() and not driver.node_reports.unanswered,
        )
    finally:
        if frozen is not None:
            os.kill(frozen, signal.SIGCONT)
        supervisor.stop()
