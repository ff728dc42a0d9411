"""A LoRA job (hf engine, the tiny model, the adapters broadcast over the collective transport)
through a trainer rank killed past its checkpoint and a rollout node SIGKILLed mid-trajectory:
the restarted trainer holds the last published adapter (loaded from the version's files, newer
than its checkpoint), the restarted node catches up from the files and then receives
broadcasts, it serves the adapter of the version it reports (the on-policy importance weight
stays 1 within 1e-3), and nothing is lost or trained twice."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.runner.driver import JobDriver
from tests.chaos.test_faults import _assert_nothing_lost, _config, _driver, _run_with
from tests.integration.buffer_helpers import rows, scalar
from tests.integration.test_lora import assert_adapters_broadcast, assert_lora_run
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(600)


def test_a_lora_job_survives_a_trainer_kill_and_a_node_kill(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    cfg = _config(tmp_path, tiny_dir, steps=1000, nodes=1)
    raw = cfg.model_dump()
    # sync: every step trains tokens of the version it starts from, so every step's on-policy
    # importance weight checks the adapter the nodes served (async runs here had none after
    # the first step under CI's load)
    raw["run"]["mode"] = "sync"
    raw["trainer"].update(lr=1e-2, checkpoint_every=2, lora={"rank": 4, "alpha": 16})
    # the adapters travel by broadcast; a restarted node catches up from the version's files
    raw["trainer"]["weights"] = {"transport": "collective", "timeout_s": 5.0}
    raw["trainer"]["loss"]["entropy_coef"] = 0.01  # the adapters move whatever the rewards
    # LoRA with objectives of their own: CISPO over plain REINFORCE++'s whitened rewards
    raw["trainer"]["loss"].update(
        policy_loss={"kind": "cispo"}, advantage={"kind": "reinforce_plus_plus"}
    )
    cfg = type(cfg).model_validate(raw)
    driver = _driver(cfg, db, tiny_dir, tmp_path)
    killed: list[int] = []

    def kill_rank(d: JobDriver) -> None:
        # step 3: its checkpoint is step 1's (version 2), version 3 is published
        if d.step == 3 and not killed:
            killed.append(d.trainer.info[0]["pid"])
            os.kill(killed[0], signal.SIGKILL)

    driver.fault_hooks["after_train"] = kill_rank

    def node_mid_trajectory() -> Any:
        got = rows(
            engine,
            """SELECT w.id, w.pid, w.name FROM workers w
               JOIN episodes e ON e.lease_owner = w.id AND e.status = 'leased'
               JOIN trajectories tr ON tr.episode_id = e.id AND tr.task_id = e.task_id
               WHERE w.role = 'rollout' AND w.status = 'alive' AND tr.status = 'in_progress'
                 AND w.loaded_version >= 2
               LIMIT 1""",
        )
        return got[0] if got else None

    def fault() -> None:
        wait_for("the trainer restarted", lambda: killed and scalar(
            engine, "SELECT count(*) FROM events WHERE kind = 'trainer.restarted'"
        ), 300)  # fmt: skip
        wid, pid, name = wait_for("a node with an adapter mid-trajectory", node_mid_trajectory)
        os.kill(pid, signal.SIGKILL)
        wait_for(
            "its replacement serving an adapter",
            lambda: rows(
                engine,
                "SELECT 1 FROM workers WHERE name = :n AND id > :w AND status = 'alive' "
                "AND loaded_version >= 1",
                n=name,
                w=wid,
            ),
            timeout_s=120,
        )
        wait_for(
            "a requeued episode finished",
            lambda: scalar(
                engine, "SELECT count(*) FROM episodes WHERE attempts >= 2 AND status = 'done'"
            ),
            timeout_s=120,
        )
        # a few steps trained on what the new node generated
        now = scalar(engine, "SELECT count(*) FROM train_steps")
        wait_for("two more steps", lambda: scalar(
            engine, "SELECT count(*) FROM train_steps") >= now + 2, 120)  # fmt: skip

    result = _run_with(driver, fault, stop_after_fault=True)
    assert killed and result.steps >= 6
    _assert_nothing_lost(db, engine, result.steps)
    kinds = [k for (k,) in rows(engine, "SELECT kind FROM events ORDER BY id")]
    assert kinds.count("trainer.restarted") == 1 and "worker.restarting" in kinds, kinds
    assert_lora_run(Path(result.run_dir), tiny_dir)
    assert_adapters_broadcast(engine, Path(result.run_dir), least=3)
