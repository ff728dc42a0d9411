"""Rollout and trainer agree with the ``vllm`` engine (CPU build, float32) on SmolLM2-135M-Instruct:
the on-policy importance weight is 1 up to numerics. Its own module, so that no other vLLM engine
(test_vllm_engine.py's module fixture) is alive beside this one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollcall.orchestrator.config import VLLMEngineConfig
from tests.support.agreement import assert_agree, describe, onpolicy_step_metrics

pytestmark = pytest.mark.timeout(900)


def test_vllm_engine_onpolicy_is_weight_is_one_on_smollm2(
    smollm2_dir: Path, ray_local: Any
) -> None:
    """SmolLM2-135M-Instruct (head size 64, which vLLM's CPU attention serves) in float32."""
    from rollcall.workers.rollout.engines.vllm import VLLMEngine

    engine = VLLMEngine(
        smollm2_dir, VLLMEngineConfig(device="cpu", dtype="float32", max_model_len=1024)
    )
    try:
        m = onpolicy_step_metrics(engine, smollm2_dir)
    finally:
        engine.close()
    print(f"vllm engine (cpu, float32), smollm2, T 1.0: {describe(m)}")
    assert_agree(m)
