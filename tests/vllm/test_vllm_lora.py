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
from tests.integration.test_lora import assert_adapters_broadcast, assert_lora_run

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
    # each version's adapter is broadcast into vLLM's worker (the file path: the test below)
    raw["trainer"]["weights"] = {"transport": "collective", "timeout_s": 5.0}
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
    assert_adapters_broadcast(engine, Path(result.run_dir), least=2)


def test_vllm_in_bf16_serves_a_bf16_adapter_from_its_files(
    vllm_tiny_dir: Path, tmp_path: Path
) -> None:
    """A bf16 trainer's adapter (``trainer.precision: bf16`` publishes in bf16) loaded from its
    files into vLLM serving bf16, as on a GPU: vLLM's log-probs are the adapted model's (a
    float32 reference with the adapter copied in), within bf16's error, which is far smaller
    than what the adapter moves them by."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollcall.orchestrator.config import LoRAConfig, VLLMEngineConfig
    from rollcall.workers import lora as adapters
    from rollcall.workers.episode.engine import GenerationRequest
    from rollcall.workers.rollout.engines.vllm import VLLMEngine
    from rollcall.workers.trainer.forward import token_logprobs
    from rollcall.workers.trainer.packing import pack
    from rollcall.workers.weights import publish_adapter

    lora = LoRAConfig(rank=4, alpha=16)

    def model() -> Any:
        return AutoModelForCausalLM.from_pretrained(vllm_tiny_dir, dtype=torch.float32).eval()

    tuned = model()
    adapters.inject(tuned, lora)
    torch.manual_seed(0)
    state = {
        n: (0.3 * torch.randn_like(p)).to(torch.bfloat16)
        for n, p in tuned.named_parameters()
        if adapters.is_adapter_param(n)
    }
    config = adapters.config_dict(lora, str(vllm_tiny_dir))
    location = publish_adapter(state, config, tmp_path, 1)
    adapters.apply_adapter(tuned, state, config, "the reference")

    engine = VLLMEngine(
        vllm_tiny_dir, VLLMEngineConfig(device="cpu", dtype="bfloat16"), lora_rank=lora.rank
    )
    try:
        engine.load_weights(1, location)
        request = GenerationRequest([5, 6, 7, 8, 9], 24, 1.0)
        (gen,) = engine.generate([request])
    finally:
        engine.close()
    assert gen.version == 1
    sequence = pack([request.prompt_ids + gen.token_ids], device="cpu")
    n = len(request.prompt_ids)
    with torch.no_grad():
        expected = token_logprobs(tuned, sequence)[0][n:].tolist()
        base = token_logprobs(model(), sequence)[0][n:].tolist()
    error = max(abs(a - b) for a, b in zip(gen.logprobs, expected, strict=True))
    moved = max(abs(a - b) for a, b in zip(base, expected, strict=True))
    print(
        f"vllm bf16 with a bf16 adapter: max log-prob error {error:.3f}, adapter moved {moved:.3f}"
    )
    assert error < 0.15 and moved > 5 * error, (error, moved)
