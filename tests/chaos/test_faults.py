"""Trainer faults injected into a running job (real processes, real PostgreSQL, real Ray, the
tiny model): a trainer rank killed between its optimizer step and the step commit, then one
frozen mid-step (its call times out). Afterwards the invariant checker passes: nothing lost,
nothing trained twice, nothing beyond its staleness bound.

The rollout node faults (SIGKILL mid-trajectory, SIGSTOP), PostgreSQL restarted and kept down
mid-run, and a second driver refused are faults of one job in test_drills.py. This module's
helpers (``_config``, ``_driver``, ``_run_with``, ``_assert_nothing_lost``) are every chaos
test's."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from rich.console import Console

from rollcall.orchestrator import procfs
from rollcall.orchestrator.buffer.invariants import check_invariants
from rollcall.orchestrator.config import RollcallConfig
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.runner.driver import JobDriver, RunResult
from tests.integration.buffer_helpers import rows, scalar

pytestmark = pytest.mark.timeout(420)


def _config(
    tmp: Path, model: Path, steps: int, nodes: int = 2, max_staleness: int = 2, **rollout: Any
) -> RollcallConfig:
    return RollcallConfig.model_validate(
        {
            "job": {"name": "chaos"},
            "model": {"path": str(model)},
            "buffer": {"batch_groups": 2, "lease_s": 30},
            "rollout": {
                "nodes": nodes,
                "concurrency": 3,
                "max_tokens_per_turn": 16,
                "max_tokens": 256,
                "heartbeat_interval_s": 0.5,
                "tool_timeout_s": 2.0,
                "restart_backoff_s": 0.5,
                "restart_window_s": 20.0,
                **rollout,
            },
            "trainer": {"lr": 1e-3, "micro_batch_tokens": 512, "restart_window_s": 20.0},
            "control_plane": {
                "seed_interval_s": 0.5,
                "dead_sweep_interval_s": 0.5,
                "heartbeat_timeout_s": 5.0,
                "progress_timeout_s": 10.0,
                "supervise_interval_s": 0.5,
            },
            "run": {
                "dir": str(tmp / "run"),
                "total_steps": steps,
                "eval": {"every": 0, "episodes": 1},
            },
            "tasks": [
                {
                    "name": "calc",
                    "plugin": "calculator",
                    "weight": 1,
                    "max_inflight": 4,
                    "max_staleness": max_staleness,
                    "spec": {"group_size": 2, "max_turns": 3},
                },
                {
                    "name": "guess",
                    "plugin": "guess",
                    "weight": 1,
                    "max_inflight": 4,
                    "max_staleness": max_staleness,
                    "spec": {"group_size": 2, "max_guesses": 4},
                },
            ],
        }
    )


def _driver(cfg: RollcallConfig, db: Database, model: Path, tmp: Path) -> JobDriver:
    return JobDriver(cfg, db, model_dir=model, home=tmp, console=Console(file=None), live=False)


def _run_with(
    driver: JobDriver, fault: Callable[[], None], *, stop_after_fault: bool = False
) -> RunResult:
    """Run the job in this thread while ``fault`` runs in another; both must finish. With
    ``stop_after_fault``, the job (its ``total_steps`` a ceiling) stops after the step during
    which ``fault`` returned: a fault that waits for its recovery never races the job's end."""
    errors: list[BaseException] = []

    def inject() -> None:
        try:
            fault()
        except BaseException as e:  # surfaced below
            errors.append(e)
        finally:
            if stop_after_fault:
                driver.request_stop()

    t = threading.Thread(target=inject, daemon=True)
    try:
        driver.setup()
        t.start()
        result = driver.run()
    finally:
        driver.close()
    t.join(timeout=60)
    if errors:
        raise errors[0]
    return result


def _assert_nothing_lost(db: Database, engine: sa.Engine, steps: int) -> None:
    job = scalar(engine, "SELECT id FROM jobs WHERE name = 'chaos'")
    report = check_invariants(db, job)
    assert report.ok, report.summary()
    assert [r[0] for r in rows(engine, "SELECT step FROM train_steps ORDER BY step")] == list(
        range(steps)
    )
    # every in-progress sample left behind by a dead node was resumed or is resumable
    assert scalar(engine, "SELECT count(*) FROM episodes WHERE status = 'leased'") == 0


def test_trainer_rank_killed_then_hung_recovers_each_time(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    """Two trainer faults in one job, each between a rank's optimizer step and the step
    commit. Step 1: the rank is SIGKILLed; the trainer restarts and replays the step on the
    batch reserved before the crash. Step 3: the rank is frozen (SIGSTOP); the driver's next
    trainer call times out (``trainer.call_timeout_s``) and the trainer goes through the normal
    recovery. The rollout node killed during the hang is restarted before that, since
    supervision does not wait on the trainer."""
    cfg = _config(tmp_path, tiny_dir, steps=5, nodes=1)
    cfg = cfg.model_copy(
        update={"trainer": cfg.trainer.model_copy(update={"call_timeout_s": 15.0})}
    )
    driver = _driver(cfg, db, tiny_dir, tmp_path)
    killed: list[int] = []
    frozen: list[tuple[int, int] | None] = []

    def fault(d: JobDriver) -> None:
        if d.step == 1 and not killed:
            pid = d.trainer.info[0]["pid"]
            killed.append(pid)
            os.kill(pid, signal.SIGKILL)
        elif d.step == 3 and not frozen:
            pid = d.trainer.info[0]["pid"]
            frozen.append(procfs.identity(pid))
            os.kill(pid, signal.SIGSTOP)
            node = rows(
                engine, "SELECT pid FROM workers WHERE role = 'rollout' AND status = 'alive'"
            )[0][0]
            os.kill(node, signal.SIGKILL)

    driver.fault_hooks["after_train"] = fault
    try:
        result = _run_with(driver, lambda: None)
    finally:
        for ident in frozen:  # ray.kill took it down; never leave a stopped process behind
            procfs.signal_same(ident, signal.SIGKILL)  # (only if its pid is still its own)
    assert killed and frozen and result.steps == 5
    _assert_nothing_lost(db, engine, 5)
    events = rows(engine, "SELECT kind, message FROM events ORDER BY id")
    kinds = [k for k, _ in events]
    # one restart per fault: the kill's, then the hang's (its call timed out)
    restarts = [i for i, k in enumerate(kinds) if k == "trainer.restarted"]
    assert len(restarts) == 2, events
    assert "TrainerTimeoutError" not in events[restarts[0]][1], events[restarts[0]]
    assert "TrainerTimeoutError" in events[restarts[1]][1], events[restarts[1]]
    # the killed node was handled while the driver still waited on the frozen trainer
    node_restart = kinds.index("worker.restarting", restarts[0])  # the kill at step 3
    assert node_restart < restarts[1], kinds
    # each replayed step trained on the batch reserved before the fault
    records = driver.run_dir.records("step")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4], records
    assert records[1]["replayed"] is True and records[3]["replayed"] is True
