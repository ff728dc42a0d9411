"""``configs/smollm2.yaml`` as a real job, shortened: SmolLM2-135M-Instruct (imported from its
GGUF file) in its own chat template with Hermes tool calls on the ``hf`` engine, the real GRPO
trainer, PostgreSQL and Ray; two steps, whose weights are published and loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from rollcall.orchestrator.config import RollcallConfig, apply_overrides, read_yaml_mapping
from rollcall.orchestrator.db.engine import Database
from tests.integration.buffer_helpers import rows, scalar
from tests.integration.test_job import _run

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "smollm2.yaml"


@pytest.mark.timeout(900)
def test_the_smollm2_config_trains_two_steps_and_its_weights_are_loaded(
    ray_local: Any, smollm2_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    data = apply_overrides(
        read_yaml_mapping(CONFIG, "config"),
        [
            "job.name=e2e",
            f"model.path={smollm2_dir}",
            f"run.dir={tmp_path / 'run'}",
            "run.total_steps=2",
            "run.eval.every=0",
            "run.eval.episodes=0",  # no evaluator: one SmolLM2 less in memory
            "buffer.batch_groups=1",
            "rollout.concurrency=4",
            "rollout.max_tokens_per_turn=48",
            "rollout.max_tokens=512",
        ],
    )
    data["tasks"][0]["spec"].update(group_size=2, max_turns=2)
    cfg = RollcallConfig.model_validate(data)
    result = _run(cfg, db, smollm2_dir, tmp_path)
    assert result.steps == 2
    job = rows(
        engine, "SELECT policy_version, weights_version, weights_uri FROM jobs WHERE name = 'e2e'"
    )[0]
    assert job[0] == 2 and job[1] == 2 and Path(job[2]).is_dir()
    loaded = scalar(engine, "SELECT max(loaded_version) FROM workers WHERE role = 'rollout'")
    assert loaded is not None and loaded >= 1  # a published version went into the engine
    # every trained trajectory is in SmolLM2's own template
    turns = rows(engine, "SELECT count(*) FROM trajectories WHERE status = 'consumed'")[0][0]
    assert turns >= 4
