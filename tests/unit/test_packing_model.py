"""Packing must not change the result, checked on the locally built tiny Qwen2 model:
packed per-token log-probs equal unpacked ones, and one packed micro-batch of 8 sequences gives
the same gradient as 8 accumulated micro-batches of 1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rollcall.orchestrator.algorithms import (
    Aggregation,
    ConstantNormaliser,
    LossConfig,
    SeqMeanTokenMean,
    TokenMean,
    TruncatedIS,
)
from rollcall.workers.trainer.forward import model_inputs, token_logprobs
from rollcall.workers.trainer.grpo import StepTotals, policy_loss, token_advantages, token_weights
from rollcall.workers.trainer.packing import pack, pack_values


def _model(tiny_dir: Path, attn: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    model.set_attn_implementation(attn)
    return model


def _sequences(vocab: int, n: int = 8, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 70, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lengths]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_equal_unpacked(tiny_dir: Path, attn: str) -> None:
    model = _model(tiny_dir, attn)
    seqs = _sequences(model.config.vocab_size)
    temperature = 0.7
    with torch.no_grad():
        packed = pack(seqs)
        assert "attention_mask" in model_inputs(model, packed)
        logp, entropy = token_logprobs(model, packed, temperature=temperature, with_entropy=True)
        assert entropy is not None
        for s, lp, ent in zip(seqs, packed.unpack(logp), packed.unpack(entropy), strict=True):
            # the reference: the sequence alone, no position ids, no mask
            logits = model(torch.tensor([s])).logits[0].float() / temperature  # [T, V]
            ref = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(s[1:])[:, None])[:, 0]
            p = torch.softmax(logits, -1)[:-1]
            ref_ent = -(p * torch.log_softmax(logits, -1)[:-1]).sum(-1)
            assert lp[0] == 0.0 and ent[0] == 0.0
            torch.testing.assert_close(lp[1:], ref, rtol=0, atol=1e-5)
            torch.testing.assert_close(ent[1:], ref_ent, rtol=0, atol=1e-5)
        # a packed row really differs from the same tokens unmasked: the mask matters
        flat = [t for s in seqs for t in s]
        unmasked = torch.log_softmax(
            model(torch.tensor([flat])).logits[0].float() / temperature, -1
        )
        later = len(seqs[0]) + 1  # second token of the second sequence
        assert abs(unmasked[later - 1, flat[later]] - logp[later]) > 1e-3


def _batch(model: Any, seqs: list[list[int]], seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Loss masks (prompt 0, then a mix), advantages, behaviour and proximal log-probs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    with torch.no_grad():
        for s in seqs:
            p = pack([s])
            old, _ = token_logprobs(model, p)
            mask = (torch.rand(len(s), generator=g) > 0.3).long()
            mask[0] = 0
            beh = old + 0.2 * torch.randn(len(s), generator=g)
            adv = token_advantages(float(torch.randn(1, generator=g)), mask)
            out.append({"mask": mask, "old": old, "beh": beh, "adv": adv})
    return out


def _grads(model: Any) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize(
    "aggregation", [TokenMean(), SeqMeanTokenMean(), ConstantNormaliser(max_tokens=64)]
)
def test_one_micro_batch_of_8_equals_8_of_1(tiny_dir: Path, aggregation: Aggregation) -> None:
    torch.manual_seed(0)
    model = _model(tiny_dir, "sdpa")
    seqs = _sequences(model.config.vocab_size, seed=3)
    data = _batch(model, seqs)
    config = LossConfig(correction=TruncatedIS(cap=1.1), aggregation=aggregation)
    totals = StepTotals.of([int(d["mask"].sum()) for d in data])

    def loss_of(idx: list[int]) -> torch.Tensor:
        packed = pack([seqs[i] for i in idx])
        logp, _ = token_logprobs(model, packed)
        weights = pack_values([token_weights(data[i]["mask"], aggregation, totals) for i in idx])
        return policy_loss(
            config,
            logp=logp,
            old_logp=pack_values([data[i]["old"] for i in idx]),
            behaviour_logp=pack_values([data[i]["beh"] for i in idx]),
            advantages=pack_values([data[i]["adv"] for i in idx]),
            weights=weights,
        ).loss

    model.zero_grad()
    one = loss_of(list(range(8)))
    one.backward()
    g_one = _grads(model)
    model.zero_grad()
    total = torch.zeros(())
    for i in range(8):
        part = loss_of([i])
        part.backward()
        total += part.detach()
    g_eight = _grads(model)

    assert len(g_one) == len(g_eight) == len(list(model.parameters()))
    norm = torch.sqrt(torch.stack([(g**2).sum() for g in g_one]).sum())
    assert norm > 1e-3  # a real gradient, not zeros compared with zeros
    torch.testing.assert_close(total, one.detach(), rtol=0, atol=1e-6)
    for a, b in zip(g_one, g_eight, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
