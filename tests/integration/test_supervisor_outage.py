"""A rollout node dies while the database is away for longer than the control plane's retries:
the supervisor cannot record the death's event. It used to have cleared the slot's actor
already, so every later pass failed on it (``ray.wait([None])``) and the slot never restarted.
Now the judgement of the death is kept on the slot and done again at the next pass.

Real Ray, a real rollout node (the tiny model) SIGKILLed, the real supervisor. The database
being away is a fake at one seam: the control-plane buffer's ``event`` raising, as it does
once its retries are spent."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from rollcall.orchestrator.buffer.control import ControlPlaneBuffer
from rollcall.orchestrator.config import BufferConfig
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.errors import DatabaseUnavailableError
from rollcall.orchestrator.runner.supervisor import Supervisor
from rollcall.workers.rollout.node import NodeConfig, rollout_actor
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(300)


class AwayForEvents(ControlPlaneBuffer):
    """Fake: ``event`` fails ``failures`` times once armed (the database away)."""

    failures = 0

    def event(self, kind: str, message: str, payload: dict[str, Any] | None = None) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise DatabaseUnavailableError("the database is away (fake)")
        super().event(kind, message, payload)


def test_a_death_whose_event_cannot_be_written_is_judged_again_and_restarted(
    ray_local: Any, tiny_dir: Path, db: Database, db_url: str
) -> None:
    buffer = AwayForEvents(db, 1, BufferConfig())

    def start(index: int) -> Any:
        config = NodeConfig(name=f"rollout-{index}", model_dir=str(tiny_dir), concurrency=1)
        return rollout_actor(num_cpus=1).remote(db_url, 1, config, BufferConfig())

    supervisor = Supervisor(buffer, start, nodes=1, max_restarts=3, backoff_base_s=0.1)
    try:

        def alive() -> list[dict[str, Any]]:
            supervisor.check()
            return [w for w in buffer.node_health() if w["status"] == "alive"]

        def slot_alive() -> bool:  # (a pass of the supervisor: it has no thread of its own)
            supervisor.check()
            return supervisor.slots[0].state == "alive"

        (first,) = wait_for("the node up", alive)
        # the node's row says alive when its engine is up, the slot once the actor's worker_id
        # call came back: a pass can see the first and not yet the second (seen on CI, twice)
        wait_for("its slot alive", slot_alive)
        buffer.failures = 2  # the death's event, and its retry at the next pass
        os.kill(int(first["pid"]), signal.SIGKILL)
        again = wait_for(
            "a new incarnation alive",
            lambda: [w for w in alive() if w["id"] != first["id"]],
            timeout_s=180,
        )
        assert again and buffer.failures == 0
        assert supervisor.slots[0].restarts == 1
    finally:
        supervisor.stop()
