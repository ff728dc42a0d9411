"""Rollout and trainer agree: on on-policy data (the trainer's weights generated the tokens, as
in sync mode at step 1) the importance weight pi_old / pi_behaviour of the ``hf`` engine's
samples is 1 up to float32 numerics, at the sampling temperature. The vLLM engine's case is
tests/vllm/test_vllm_agreement.py; both use ``tests.support.agreement``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.agreement import assert_agree, describe, onpolicy_step_metrics

pytestmark = pytest.mark.timeout(600)


def hf_onpolicy_is_weight(model_dir: Path, **batch: Any) -> dict[str, float]:
    """One on-policy step's metrics for the ``hf`` engine in float32 on ``model_dir``."""
    from rollcall.workers.rollout.engines.hf import HFEngine

    engine = HFEngine(model_dir, seed=0, dtype="float32")
    return onpolicy_step_metrics(engine, model_dir, **batch)


# The tiny model and SmolLM2-135M-Instruct (imported from its GGUF file), at the job's
# temperature (1.0) and another: at 1.0 raw and temperature-scaled log-probs are the same, at
# 0.7 only the scaled ones (what both sides must use) agree. The tiny model's random logits are
# nearly flat, so SmolLM2 at 0.7 is the case that tells scaled from raw log-probs; SmolLM2 at
# 1.0 (minutes) is in the long tier: on every push, the tiny model holds 1.0 and SmolLM2 the
# real model's agreement at 0.7. SmolLM2 samples 2 groups of 4 (the tiny model 4 of 4).
@pytest.mark.parametrize(
    ("model", "temperature"),
    [
        ("tiny_dir", 1.0),
        ("tiny_dir", 0.7),
        pytest.param("smollm2_dir", 1.0, marks=pytest.mark.long),
        ("smollm2_dir", 0.7),
    ],
)
def test_hf_engine_onpolicy_is_weight_is_one(
    model: str, temperature: float, request: pytest.FixtureRequest, ray_local: Any
) -> None:
    model_dir: Path = request.getfixturevalue(model)
    batch: dict[str, Any] = {"prompts": 2} if model == "smollm2_dir" else {}
    m = hf_onpolicy_is_weight(model_dir, temperature=temperature, **batch)
    print(f"hf engine, {model}, T {temperature}: {describe(m)}")
    assert_agree(m)


def test_a_temperature_mismatch_moves_the_is_weight(tiny_dir: Path, ray_local: Any) -> None:
    """The check can fail: samples drawn at temperature 1 scored by a trainer at 0.5. The mean
    weight hardly tells (it is 1 in expectation under any mismatch: measured 1.0074); the mean
    log-weight, -KL(behaviour || trainer), is clearly below 0 (-9.2e-3 measured; the tiny
    model's random logits are nearly flat, so a temperature changes them little)."""
    from rollcall.workers.rollout.engines.hf import HFEngine

    engine = HFEngine(tiny_dir, seed=0, dtype="float32")
    m = onpolicy_step_metrics(engine, tiny_dir, trainer_temperature=0.5)
    print(f"hf engine, sampled at T 1.0, scored at 0.5: {describe(m)}")
    assert m["onpolicy_tokens"] == m["tokens"] > 0
    assert m["is_log_weight_onpolicy_mean"] < -2e-3
    with pytest.raises(AssertionError):
        assert_agree(m)


def test_a_job_whose_rollout_log_probs_disagree_warns_once(
    ray_local: Any, tiny_dir: Path, db: Any, engine: Any, tmp_path: Path
) -> None:
    """A rollout engine that reports log-probs 0.1 off (``faults.shifted_logprobs``) puts the
    on-policy weight at 1.105, out of the default tolerance (0.05): the driver warns once (one
    ``trainer.is_weight_drift`` event, not one per step: two steps) and marks the steps in
    metrics.jsonl. No held-out evaluation: it is not what this job checks."""
    import math

    from rich.console import Console

    from rollcall.orchestrator.runner.driver import JobDriver
    from tests.integration.buffer_helpers import rows
    from tests.integration.test_job import _config

    cfg = _config(tmp_path, tiny_dir, total_steps=2, eval={"every": 0, "episodes": 0})
    driver = JobDriver(
        cfg, db, model_dir=tiny_dir, home=tmp_path, console=Console(file=None), live=False
    )
    driver.engine_hooks[0] = "tests.support.faults:shifted_logprobs"
    try:
        driver.setup()
        result = driver.run()
    finally:
        driver.close()
    assert result.steps == 2
    events = rows(
        engine, "SELECT message, payload FROM events WHERE kind = 'trainer.is_weight_drift'"
    )
    assert len(events) == 1, events
    (message, payload), *_ = events
    assert payload["step"] == 0 and abs(payload["weight"] - math.exp(0.1)) < 1e-3, message
    steps = driver.run_dir.records("step")
    assert steps[0]["is_weight_drift"] == 1.0
    assert abs(steps[0]["is_log_weight_onpolicy_mean"] - 0.1) < 1e-3
    # one warning line in the driver's log
    log = driver.run_dir.log_path.read_text()
    assert log.count("the on-policy importance weight is 1.10") == 1, log[-2000:]
