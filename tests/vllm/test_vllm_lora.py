"""A LoRA job on real vLLM (CPU build, float32): every version is published as the adapter
alone and served by vLLM as a ``LoRARequest`` of its own; the trainer's on-policy importance
weight stays 1 within 1e-3 at every step after the first, which an adapter that never reached
vLLM could not give once the adapters have moved the policy (checked here too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from rollcall.orchestrator.db.engine import Database
from tests.chaos.test_faults import _assert_nothing_lost, _config, _driver
from tests.integration.buffer_helpers import scalar
from tests.integration.test_lora import assert_lora_run

pytestmark = pytest.mark.timeout(900)


def test_a_lora_job_on_vllm_serves_each_versions_adapter(
    ray_local: Any, vllm_tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    cfg = _config(
        tmp_path,
        vllm_tiny_dir,
        steps=4,
        nodes=1,
        engine={"kind": "vllm", "device": "cpu", "dtype": "float32"},
        start_timeout_s=300.0,
    )
    raw = cfg.model_dump()
    raw["run"]["mode"] = "sync"
    # every step moves the adapters whatever the rewards (the entropy term): the tiny model
    # rarely earns a reward
    raw["trainer"].update(lr=1e-2, lora={"rank": 4, "alpha": 16})
    raw["trainer"]["loss"]["entropy_coef"] = 0.01
    # LoRA with objectives of their own: GSPO's sequence ratio over RLOO's advantages
    raw["trainer"]["loss"].update(policy_loss={"kind": "gspo"}, advantage={"kind": "rloo"})
    cfg = type(cfg).model_validate(raw)
    driver = _driver(cfg, db, vllm_tiny_dir, tmp_path)
    try:
        driver.setup()
        result = driver.run()
    finally:
        driver.close()
    assert result.steps == 4
    _assert_nothing_lost(db, engine, 4)
    assert scalar(engine, "SELECT max(loaded_version) FROM workers WHERE role = 'rollout'") >= 3
    assert_lora_run(Path(result.run_dir), vllm_tiny_dir)
