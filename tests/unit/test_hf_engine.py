"""The hf engine's batched generation with KV reuse: the rows of a batch start from their own
cached prefixes, log-probs still equal a teacher-forced forward pass, and reuse changes
nothing but the work done."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rollcall.workers.episode.engine import Generation, GenerationRequest
from rollcall.workers.rollout.engines.hf import HFEngine, catch_up_width

TEMPERATURE = 1.3


def _play(engine: HFEngine, turns: int) -> tuple[list[list[int]], list[list[Generation]]]:
    """Five trajectories of different lengths generated as one batch per turn, with a tool
    observation appended after every turn (so contexts grow and differ in length)."""
    tok = engine.tokenizer

    def enc(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    contexts = [enc(f"<|system|>\nTools\n<|user|>\nq{i} {'x' * 7 * i}\n<|assistant|>\n") for i in range(5)]  # fmt: skip
    history: list[list[Generation]] = [[] for _ in contexts]
    for turn in range(turns):
        gens = engine.generate(
            [GenerationRequest(c, 6 + 3 * i, TEMPERATURE) for i, c in enumerate(contexts)]
        )
        for i, g in enumerate(gens):
            history[i].append(g)
            contexts[i] = (
                contexts[i] + g.token_ids + enc(f"\n<|tool|>\nobs {turn}\n<|assistant|>\n")
            )
    return contexts, history


def test_batched_kv_reuse_keeps_logprobs_exact(tiny_dir: Path) -> None:
    engine = HFEngine(tiny_dir, seed=3)
    contexts, history = _play(engine, turns=4)
    # After the first turn every row started from its own previous turn's cache.
    for gens in history:
        assert gens[0].cached_tokens == 0
        assert all(g.cached_tokens > 0 for g in gens[1:])
    assert engine.reused_tokens > engine.prefilled_tokens
    # Behaviour log-probs equal a teacher-forced forward pass over the whole trajectory.
    for ctx, gens in zip(contexts, history, strict=True):
        with torch.no_grad():
            logits = engine.model(torch.tensor([ctx])).logits[0].float() / TEMPERATURE
        lp = torch.log_softmax(logits, dim=-1)  # [T, V]
        pos = 0
        for g in gens:
            start = _find(ctx, g.token_ids, pos)
            for j, t in enumerate(g.token_ids):
                assert abs(lp[start + j - 1, t].item() - g.logprobs[j]) < 1e-4
            pos = start + len(g.token_ids)


def _flat(history: list[list[Generation]]) -> list[Generation]:
    return [g for gens in history for g in gens]


def _find(seq: list[int], sub: list[int], start: int) -> int:
    for i in range(start, len(seq) - len(sub) + 1):
        if seq[i : i + len(sub)] == sub:
            return i
    raise AssertionError("generated tokens not in the trajectory")


def test_reuse_changes_only_the_work_done(tiny_dir: Path) -> None:
    """Same seed with and without KV reuse: the same tokens and log-probs (up to float
    rounding), while reuse prefills far fewer tokens."""
    with_reuse = HFEngine(tiny_dir, seed=5)
    without = HFEngine(tiny_dir, seed=5, kv_reuse=False)
    a_ctx, a = _play(with_reuse, turns=4)
    b_ctx, b = _play(without, turns=4)
    assert a_ctx == b_ctx
    for ga, gb in zip(_flat(a), _flat(b), strict=True):
        assert ga.token_ids == gb.token_ids and ga.finish_reason == gb.finish_reason
        assert max(abs(x - y) for x, y in zip(ga.logprobs, gb.logprobs, strict=True)) < 1e-4
    assert without.reused_tokens == 0 and without.cache_hits == 0
    assert with_reuse.prefilled_tokens < without.prefilled_tokens / 2


def test_new_weights_drop_the_caches(tiny_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    engine = HFEngine(tiny_dir, seed=0)
    _play(engine, turns=2)
    assert len(engine.kv) > 0
    state = {k: v.clone().contiguous() for k, v in engine.model.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    engine.load_weights(1, str(tmp_path))
    assert engine.version == 1 and len(engine.kv) == 0 and engine.kv.tokens == 0


def test_catch_up_width_minimises_the_tokens_fed() -> None:
    # one long row among short ones: the window is the short rows' longest
    assert catch_up_width([10, 12, 9, 400], slack=32) == 12
    # similar rows: no catch-up (the window is the longest)
    assert catch_up_width([30, 40, 35, 45], slack=32) == 45
    # half the batch long: still cheaper to prefill the long half first
    assert catch_up_width([20, 20, 300, 300], slack=32) == 20
    # a long tail that is not worth an extra pass
    assert catch_up_width([100, 100, 100, 110], slack=32) == 110
    assert catch_up_width([7], slack=32) == 7


def test_a_new_long_context_does_not_widen_the_batch(tiny_dir: Path) -> None:
    """Continuing trajectories (cached) batched with a new one whose whole long prompt is
    uncached: the new row is prefilled on its own first, every row still gets exact log-probs
    and the tokens fed are about each row's own uncached part, not B x the longest."""
    engine = HFEngine(tiny_dir, seed=11)
    contexts, _ = _play(engine, turns=2)
    tok = engine.tokenizer
    fresh = list(tok.encode("<|user|>\n" + "a long new question " * 20, add_special_tokens=False))
    catch_ups = engine.catch_ups
    fed: list[int] = []  # input positions of every multi-token forward pass (the prefills)

    def count(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs["input_ids"]
        if ids.shape[1] > 1:
            fed.append(ids.numel())

    requests = [GenerationRequest(c, 5, TEMPERATURE) for c in [*contexts, fresh]]
    hook = engine.model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        gens = engine.generate(requests)
    finally:
        hook.remove()
    assert engine.catch_ups == catch_ups + 1 and len(fed) == 2  # the catch-up, then the batch
    assert gens[-1].cached_tokens == 0 and all(g.cached_tokens > 0 for g in gens[:-1])
    uncached = [len(r.prompt_ids) - g.cached_tokens for r, g in zip(requests, gens, strict=True)]
    assert sum(fed) < len(requests) * max(uncached) / 2  # one wide window would feed B x max
    for r, g in zip(requests, gens, strict=True):
        seq = list(r.prompt_ids) + g.token_ids
        with torch.no_grad():
            logits = engine.model(torch.tensor([seq])).logits[0].float() / TEMPERATURE
        lp = torch.log_softmax(logits, dim=-1)  # [T, V]
        n = len(r.prompt_ids)
        for j, t in enumerate(g.token_ids):
            assert abs(lp[n + j - 1, t].item() - g.logprobs[j]) < 1e-4


def test_tokens_count_while_a_batch_generates(tiny_dir: Path) -> None:
    """The node's progress (``health().tokens_generated``, which the heartbeat reports) grows
    with every decoding step, not only when a batch's generate call returns: a real model's
    batch of long turns on a loaded CPU takes longer than the control plane's progress timeout
    (seen with SmolLM2-135M: a node declared hung while it was generating)."""
    engine = HFEngine(tiny_dir, seed=0)
    seen: list[int] = []
    forward = engine._forward

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(engine.health().tokens_generated)
        return forward(*args, **kwargs)

    engine._forward = recording  # type: ignore[method-assign]
    requests = [GenerationRequest([5, 6, 7], 40, 1.0) for _ in range(2)]
    gens = engine.generate(requests)
    total = sum(len(g.token_ids) for g in gens)
    assert engine.health().tokens_generated == total
    assert len(seen) > 2 and 0 < seen[2] < total, seen[:5]
