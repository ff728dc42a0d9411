"""A trainer crash whose last checkpoint is several steps back (``trainer.checkpoint_every`` > 1):
the restarted trainer continues from the last *published* weights, so every version the
rollout nodes ever saw is an ancestor of the next one (no old weights under a newer version),
and the failure and the recovery are events."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator.db.engine import Database
from orchestrator.runner.driver import JobDriver
from tests.chaos.test_faults import _assert_nothing_lost, _config, _driver, _run_with
from tests.integration.buffer_helpers import rows

pytestmark = pytest.mark.timeout(600)


def _weights(location: str | Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(Path(location) / "model.safetensors"))


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_crash_three_steps_past_the_checkpoint_continues_from_the_published_weights(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    """checkpoint_every 3, weights published every step: the checkpoint of step 2 holds
    version 3, versions 4 and 5 are published when a rank dies at step 5 (after its optimizer
    step, before the checkpoint and commit). The restarted trainer holds exactly version 5's
    weights (today it held the checkpoint's version 3 and published them, trained once more,
    as version 6)."""
    cfg = _config(tmp_path, tiny_dir, steps=6, nodes=1)
    trainer = cfg.trainer.model_copy(
        update={
            "checkpoint_every": 3,
            "keep_weights": 10,
            # every step moves the weights, whatever the rewards (the entropy term)
            "loss": cfg.trainer.loss.model_copy(update={"entropy_coef": 0.01}),
        }
    )
    cfg = cfg.model_copy(update={"trainer": trainer})
    driver = _driver(cfg, db, tiny_dir, tmp_path)
    killed: list[int] = []
    probes: list[tuple[int, str]] = []

    def kill_rank(d: JobDriver) -> None:
        if d.step == 5 and not killed:
            pid = d.trainer.info[0]["pid"]
            killed.append(pid)
            os.kill(pid, signal.SIGKILL)

    start_trainer = driver._start_trainer

    def start_then_probe() -> None:
        start_trainer()
        if killed and not probes:  # the restart: what does the new trainer hold?
            probe = driver.trainer.publish(str(tmp_path / "probe"), 99)
            probes.append((driver.step, probe))

    driver._start_trainer = start_then_probe  # type: ignore[method-assign]
    driver.fault_hooks["after_train"] = kill_rank
    result = _run_with(driver, lambda: None)
    assert killed and result.steps == 6
    _assert_nothing_lost(db, engine, 6)
    weights = driver.run_dir.weights
    v3, v5 = _weights(weights / "v000003"), _weights(weights / "v000005")
    assert not _same(v3, v5), "steps 3 and 4 did not change the weights: the test proves nothing"
    assert probes and probes[0][0] == 5
    restarted = _weights(probes[0][1])
    assert not _same(restarted, v3), "the restarted trainer went back to the checkpoint's weights"
    assert _same(restarted, v5), "the restarted trainer does not hold the last published weights"
    # version 6 was trained from version 5: it differs from it (the replayed step trained)
    assert not _same(_weights(weights / "v000006"), v5)
    # the failure is an event before the restart is attempted, the recovery one after it
    kinds = [k for (k,) in rows(engine, "SELECT kind FROM events ORDER BY id")]
    assert kinds.count("trainer.down") == 1 and kinds.count("trainer.restarted") == 1
    assert kinds.index("trainer.down") < kinds.index("trainer.restarted")
