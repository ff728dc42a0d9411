"""LoRA on the FSDP2 trainer (two ranks on real Ray actors, gloo) and the tiny model: only the
adapters train and have optimizer state, a version is the adapter alone in peft's format, the
``hf`` engine applies it exactly as peft does, a checkpoint resumes bit for bit, and the final
policy is the adapter plus the merged model in transformers format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rollcall.orchestrator.config import LoRAConfig, TrainerConfig
from rollcall.workers import lora as adapters
from rollcall.workers.trainer.group import TrainerGroup
from tests.integration.test_trainer import LOSS, _plan

LORA = LoRAConfig(rank=4, alpha=8)


def _config() -> TrainerConfig:
    return TrainerConfig(ranks=2, lr=1e-2, loss=LOSS, micro_batch_tokens=120, lora=LORA)


def _logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(torch.tensor([ids])).logits[0]
    return out


@pytest.mark.timeout(600)
def test_lora_trains_and_publishes_only_the_adapter(
    ray_local: Any, tiny_dir: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollcall.workers.rollout.engines.hf import HFEngine

    vocab = AutoConfig.from_pretrained(tiny_dir).vocab_size
    group = TrainerGroup(_config(), str(tiny_dir), total_steps=4, seed=0)
    try:
        for step in range(2):
            group.train(_plan(step, vocab, 2, LOSS))
        ckpt = group.save_checkpoint(str(tmp_path / "ckpt-1"), 1)
        v2 = Path(group.publish(str(tmp_path / "w"), 2))
        group.train(_plan(2, vocab, 2, LOSS))
        v3 = Path(group.publish(str(tmp_path / "w"), 3))
        final = Path(group.save_final(str(tmp_path / "final")))
    finally:
        group.shutdown()

    # a version is the adapter alone, in peft's format: its bytes are the adapters' float32s
    assert sorted(p.name for p in v2.iterdir()) == [adapters.ADAPTER_CONFIG, adapters.ADAPTER_FILE]
    published = load_file(str(v2 / adapters.ADAPTER_FILE))
    fresh = AutoModelForCausalLM.from_pretrained(tiny_dir)
    trainable = adapters.inject(fresh, LORA)
    assert sum(t.numel() for t in published.values()) == trainable
    adapter_bytes = sum(t.numel() * t.element_size() for t in published.values())
    full_bytes = sum(
        p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(tiny_dir).parameters()
    )
    assert (v2 / adapters.ADAPTER_FILE).stat().st_size < adapter_bytes + 64 * 1024
    assert adapter_bytes < full_bytes / 10
    # the adapters trained (lora_B starts at 0)
    assert max(float(t.abs().max()) for k, t in published.items() if "lora_B" in k) > 1e-4

    # the hf engine applies a version exactly as peft's own loader does
    engine = HFEngine(str(tiny_dir), seed=0)
    ids = [1, 7, 19, 40, 3, 88, 12]
    base = _logits(engine.model, ids)
    engine.load_weights(2, str(v2))
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir), str(v2))
    torch.testing.assert_close(_logits(engine.model, ids), _logits(reference.eval(), ids))
    assert float((_logits(engine.model, ids) - base).abs().max()) > 1e-4
    engine.load_weights(3, str(v3))  # the next version replaces it (no second injection)
    assert engine.health().version == 3

    # the final policy: the adapter, and the model merged (W + alpha/r B A) in transformers form
    merged = AutoModelForCausalLM.from_pretrained(final).eval()
    last = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_dir), str(final / "adapter")
    )
    torch.testing.assert_close(
        _logits(merged, ids), _logits(last.eval(), ids), rtol=1e-4, atol=1e-4
    )
    torch.testing.assert_close(_logits(engine.model, ids), _logits(last.eval(), ids))

    # a trainer restarted from the checkpoint of step 1 trains step 2 to the same adapter
    group = TrainerGroup(_config(), str(tiny_dir), total_steps=4, seed=0)
    try:
        assert group.load_checkpoint(ckpt) == 1
        group.train(_plan(2, vocab, 2, LOSS))
        again = Path(group.publish(str(tmp_path / "w-resumed"), 3))
    finally:
        group.shutdown()
    expected = load_file(str(v3 / adapters.ADAPTER_FILE))
    got = load_file(str(again / adapters.ADAPTER_FILE))
    assert got.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=0)


def assert_lora_run(run: Path, model_dir: Path) -> None:
    """A finished LoRA job's run directory: every published version is an adapter alone, the
    on-policy importance weight of every step after the first is 1 within 1e-3 (the nodes
    generated with the adapter of the version they reported), the adapters moved the policy
    far beyond that (a node serving the base model would have been seen), and the final policy
    is the adapter plus the merged model."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    versions = sorted(p for p in (run / "weights").glob("v*") if p.is_dir())
    assert versions
    for v in versions:
        assert sorted(p.name for p in v.iterdir()) == [
            adapters.ADAPTER_CONFIG,
            adapters.ADAPTER_FILE,
        ]
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step" and r.get("onpolicy_tokens", 0) > 0]
    later = [r for r in steps if r["step"] >= 1]
    assert later, [r.get("onpolicy_tokens") for r in records if r["kind"] == "step"]
    for r in later:
        assert abs(r["is_weight_onpolicy_mean"] - 1.0) < 1e-3, r
        assert abs(r["is_log_weight_onpolicy_mean"]) < 1e-3, r
    # the final adapter moves log-probs by far more than that tolerance
    ids = list(range(3, 40))
    base = torch.log_softmax(_logits(AutoModelForCausalLM.from_pretrained(model_dir), ids), -1)
    final = AutoModelForCausalLM.from_pretrained(run / "final").eval()
    tuned = torch.log_softmax(_logits(final, ids), -1)
    picked = torch.tensor(ids[1:])
    shift = (tuned[:-1].gather(1, picked[:, None]) - base[:-1].gather(1, picked[:, None])).abs()
    assert float(shift.mean()) > 1e-2, float(shift.mean())
    adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir), str(run / "final" / "adapter")
    )
    torch.testing.assert_close(
        _logits(adapter.eval(), ids), _logits(final, ids), rtol=1e-4, atol=1e-4
    )


def test_lora_target_modules_the_model_lacks_are_one_sentence(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"\['qkv'\] are not linear layers of .*; it has"):
        adapters.check_targets(tiny_dir, ["q_proj", "qkv"])
    adapters.check_targets(tiny_dir, list(LORA.target_modules))


def assert_adapters_broadcast(engine: Any, run: Path, least: int) -> None:
    """The collective transport carried each LoRA version as its adapter alone: every
    broadcast's bytes are a published adapter's (the version's file holds exactly those
    tensors), and the nodes loaded at least ``least`` versions by broadcast."""
    from safetensors.torch import load_file

    from tests.integration.test_weight_broadcast import broadcasts

    last = sorted(p for p in (run / "weights").glob("v*") if p.is_dir())[-1]
    published = load_file(str(last / adapters.ADAPTER_FILE))
    adapter_bytes = sum(t.numel() * t.element_size() for t in published.values())
    sent = [e for e in broadcasts(engine) if "bytes" in e]
    assert sent, broadcasts(engine)
    for e in sent:
        assert e["adapter"] and e["bytes"] == adapter_bytes, (e, adapter_bytes)
    loaded = [e for e in sent if e["loaded"]]
    assert len(loaded) >= least, sent
