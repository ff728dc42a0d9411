"""Chunked log-probs (the output head applied a few positions at a time, recomputed in
backward) must equal the whole-row computation, values and gradients, on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollcall.workers.trainer.forward import token_logprobs
from rollcall.workers.trainer.packing import pack

LENGTHS = (23, 5, 41, 1, 17)  # 87 tokens: 86 scored positions, divided by neither chunk size


@pytest.mark.parametrize("chunk", [9, 40])
def test_chunked_logprobs_and_gradients_equal_unchunked(tiny_dir: Path, chunk: int) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    packed = pack(seqs)
    assert (packed.tokens - 1) % chunk != 0
    a, b = torch.randn(packed.tokens, generator=g), torch.randn(packed.tokens, generator=g)

    def run(chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        logp, ent = token_logprobs(
            model, packed, temperature=0.7, with_entropy=True, chunk_tokens=chunk_tokens
        )
        assert ent is not None
        ((a * logp).mean() + (b * ent).mean()).backward()  # token means, as the losses
        grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        return logp.detach(), ent.detach(), grads

    logp, ent, grads = run(0)
    c_logp, c_ent, c_grads = run(chunk)
    first = packed.position_ids[0] == 0
    assert (logp[first] == 0).all() and (logp[~first] < 0).all() and (ent[~first] > 0).all()
    torch.testing.assert_close(c_logp, logp, rtol=0, atol=1e-6)
    torch.testing.assert_close(c_ent, ent, rtol=0, atol=1e-6)
    assert len(grads) == len(list(model.parameters()))
    assert min(float(g.abs().max()) for g in grads) > 1e-5  # every parameter gets a real gradient
    # The chunks' gradients add up in another order than one product over the row: float32
    # rounding, up to 8.2e-8 seen (the largest entries are 0.13).
    for cg, ref in zip(c_grads, grads, strict=True):
        torch.testing.assert_close(cg, ref, rtol=0, atol=1e-6)
