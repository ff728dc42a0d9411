"""Rollout and trainer agree with the ``vllm`` engine (CPU build, float32): on on-policy data the
importance weight pi_old / pi_behaviour the trainer reports is 1 up to numerics, at the sampling
temperature. The ``hf`` engine's case is tests/integration/test_agreement.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollcall.orchestrator.config import VLLMEngineConfig
from tests.support.agreement import assert_agree, describe, onpolicy_step_metrics

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def vllm_float32(vllm_tiny_dir: Path) -> Iterator[Any]:
    from rollcall.workers.rollout.engines.vllm import VLLMEngine

    # vLLM on CPU serves float32 when asked; dtype "auto" serves this float32 model in bf16
    # (measured: as with dtype "bfloat16", on-policy mean log-weight 5.7e-5, max weight 1.0043)
    engine = VLLMEngine(vllm_tiny_dir, VLLMEngineConfig(device="cpu", dtype="float32"))
    try:
        yield engine
    finally:
        engine.close()


# At 1.0 (the job's) and 0.7: only there do raw and temperature-scaled log-probs differ.
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_engine_onpolicy_is_weight_is_one(
    vllm_float32: Any, vllm_tiny_dir: Path, ray_local: Any, temperature: float
) -> None:
    m = onpolicy_step_metrics(vllm_float32, vllm_tiny_dir, temperature=temperature)
    print(f"vllm engine (cpu, float32), tiny, T {temperature}: {describe(m)}")
    assert_agree(m)


def test_vllm_loads_bf16_published_weights_into_its_float32_model(
    vllm_float32: Any, vllm_tiny_dir: Path, tmp_path: Path
) -> None:
    """A bf16 trainer's publication (``trainer.precision: bf16``) loads into a float32 vLLM
    engine: it then samples from exactly those weights (upcast), as the trainer scores them."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rollcall.workers.episode.engine import GenerationRequest
    from rollcall.workers.trainer.forward import token_logprobs
    from rollcall.workers.trainer.packing import pack
    from rollcall.workers.weights import publish

    torch.manual_seed(3)
    state = load_file(str(vllm_tiny_dir / "model.safetensors"))
    state.pop("lm_head.weight", None)  # tied: the trainer publishes without it
    bf16 = {k: (v + 0.05 * torch.randn_like(v)).to(torch.bfloat16) for k, v in state.items()}
    vllm_float32.load_weights(1, publish(bf16, tmp_path, 1))
    req = GenerationRequest([5, 6, 7, 8, 9], 24, 1.0)
    (gen,) = vllm_float32.generate([req])
    assert gen.version == 1

    model = AutoModelForCausalLM.from_pretrained(str(vllm_tiny_dir), dtype=torch.float32).eval()
    model.load_state_dict({k: v.float() for k, v in bf16.items()}, strict=False)
    model.tie_weights()
    with torch.no_grad():
        lp = token_logprobs(model, pack([req.prompt_ids + gen.token_ids], device="cpu"))[0]
    n = len(req.prompt_ids)
    err = max(abs(float(lp[n + i]) - b) for i, b in enumerate(gen.logprobs))
    print(f"vllm float32 engine on bf16-published weights: max log-prob error {err:.2e}")
    assert err < 1e-4
