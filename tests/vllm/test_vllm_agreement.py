"""Rollout and trainer agree with the ``vllm`` engine (CPU build, float32): on on-policy data the
importance weight pi_old / pi_behaviour the trainer reports is 1 up to numerics, at the sampling
temperature. The ``hf`` engine's case is tests/integration/test_agreement.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import VLLMEngineConfig
from tests.support.agreement import assert_agree, describe, onpolicy_step_metrics

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def vllm_float32(vllm_tiny_dir: Path) -> Iterator[Any]:
    from workers.rollout.engines.vllm import VLLMEngine

    # vLLM on CPU serves float32 when asked (dtype "auto" would keep the folder's dtype)
    engine = VLLMEngine(vllm_tiny_dir, VLLMEngineConfig(device="cpu", dtype="float32"))
    try:
        yield engine
    finally:
        engine.close()


# TODO(smollm2): the SmolLM2 case goes here once tests/conftest.py has the session fixture
# ``smollm2_dir``: a module fixture like ``vllm_float32`` on it (head size 64 is one vLLM's CPU
# attention serves), then the same ``onpolicy_step_metrics(engine, smollm2_dir)`` check.
def test_vllm_engine_onpolicy_is_weight_is_one(
    vllm_float32: Any, vllm_tiny_dir: Path, ray_local: Any
) -> None:
    m = onpolicy_step_metrics(vllm_float32, vllm_tiny_dir)
    print(f"vllm engine (cpu, float32), tiny: {describe(m)}")
    assert_agree(m)
