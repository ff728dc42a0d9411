"""The FSDP2 trainer on real Ray actors (gloo, CPU) and the tiny model: two ranks train like one,
and resuming from a checkpoint matches an uninterrupted run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rollcall.orchestrator.algorithms import LossConfig, SeqMeanTokenMean, TruncatedIS
from rollcall.orchestrator.buffer.types import Batch
from rollcall.orchestrator.config import TrainerConfig
from rollcall.orchestrator.domain import BatchGroup, BatchTrajectory, TrajectoryPayload
from rollcall.workers.trainer.batch import StepPlan, plan_step
from rollcall.workers.trainer.group import TrainerGroup
from rollcall.workers.weights import WEIGHTS_FILE


def _batch(step: int, vocab: int, groups: int = 4, group_size: int = 4) -> Batch:
    """A synthetic batch: random tokens, a prompt then generated tokens, 0/1 rewards."""
    rng = np.random.default_rng(100 + step)
    out = []
    for g in range(groups):
        trajs = []
        for i in range(group_size):
            n, prompt = int(rng.integers(12, 60)), int(rng.integers(4, 10))
            mask = np.r_[np.zeros(prompt), np.ones(n - prompt)].astype(np.uint8)
            logp = np.where(mask == 1, -rng.uniform(0.5, 6.0, n), 0.0).astype(np.float32)
            payload = TrajectoryPayload.build(
                rng.integers(0, vocab, n), mask, logp, turn_offsets=[prompt], turn_versions=[step]
            )
            trajs.append(BatchTrajectory(i, payload, float(rng.integers(0, 2))))
        out.append(BatchGroup(g, 1, "calc" if g % 2 else "guess", {}, step, tuple(trajs)))
    return Batch(step, step, tuple(out), {}, False, {})


def _plan(step: int, vocab: int, ranks: int, loss: LossConfig) -> StepPlan:
    return plan_step(_batch(step, vocab), loss, ranks=ranks, micro_batch_tokens=120)


def _weights(group: TrainerGroup, root: Path, version: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(group.publish(str(root), version)) / WEIGHTS_FILE))


LOSS = LossConfig(correction=TruncatedIS(cap=2.0), aggregation=SeqMeanTokenMean())


def _config(ranks: int) -> TrainerConfig:
    return TrainerConfig(ranks=ranks, lr=1e-3, loss=LOSS, mini_batches=2, micro_batch_tokens=120)


@pytest.mark.timeout(600)
def test_two_ranks_train_like_one_and_resume_matches(
    ray_local: Any, tiny_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_dir).vocab_size
    results: dict[str, dict[str, torch.Tensor]] = {}
    # 1 rank and 2 ranks, 3 steps each (2 optimizer updates per step), same data.
    for ranks in (1, 2):
        group = TrainerGroup(_config(ranks), str(tiny_dir), total_steps=4, seed=0)
        try:
            for step in range(3):
                plan = _plan(step, vocab, ranks, LOSS)
                assert len({len(m) for m in plan.mini_batches[0]}) == 1  # same count per rank
                metrics = group.train(plan)
                assert metrics["tokens"] > 0 and np.isfinite(metrics["loss"])
                if step == 1 and ranks == 1:
                    ckpt = group.save_checkpoint(str(tmp_path / "ckpt-1"), step)
            results[f"ranks{ranks}"] = _weights(group, tmp_path / f"w{ranks}", 3)
        finally:
            group.shutdown()
    from safetensors.torch import load_file

    start = load_file(str(tiny_dir / "model.safetensors"))
    one, two = results["ranks1"], results["ranks2"]
    moved = max(float((one[k] - start[k]).abs().max()) for k in one)
    assert moved > 1e-3  # training changed the weights
    # Two ranks reduce gradients in another order: float rounding differs (2.1e-6 seen after
    # six AdamW updates at lr 1e-3), a hundred times below how far training moved the weights.
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=1e-5)

    # Resume: a fresh trainer loads the checkpoint after step 1 and trains step 2.
    group = TrainerGroup(_config(1), str(tiny_dir), total_steps=4, seed=0)
    try:
        assert group.load_checkpoint(ckpt) == 1
        group.train(_plan(2, vocab, 1, LOSS))
        resumed = _weights(group, tmp_path / "w-resumed", 3)
    finally:
        group.shutdown()
    for k in one:
        torch.testing.assert_close(resumed[k], one[k], rtol=0, atol=0)


def _seq_logp(model: Any, ids: list[int], prompt: int) -> float:
    """Sum of the log-probs of the generated tokens (after ``prompt``) at temperature 1."""
    from rollcall.workers.trainer.forward import token_logprobs
    from rollcall.workers.trainer.packing import pack

    with torch.no_grad():
        lp, _ = token_logprobs(model, pack([ids]))
    return float(lp[prompt:].sum())


# the loss kinds a step is tried with: the two corrections of PPO, and each new objective
# (policy loss, advantage and shaping kinds paired so that three steps try all of them)
STEP_LOSSES = {
    "tis": {"correction": {"kind": "tis", "cap": 2.0}},
    "none": {"correction": {"kind": "none"}},
    "gspo+rloo": {"policy_loss": {"kind": "gspo"}, "advantage": {"kind": "rloo"}},
    "cispo+reinforce_pp_baseline": {
        "policy_loss": {"kind": "cispo"},
        "advantage": {"kind": "reinforce_plus_plus_baseline"},
    },
    "reinforce_pp+overlong": {
        "advantage": {"kind": "reinforce_plus_plus"},
        "reward_shaping": {"kind": "overlong", "max_tokens": 8, "buffer_tokens": 4},
    },
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kinds", list(STEP_LOSSES))
def test_a_step_moves_the_policy_towards_the_rewarded_sample(
    ray_local: Any, tiny_dir: Path, tmp_path: Path, kinds: str
) -> None:
    """One group: the same prompt, four continuations, reward 1 for two of them. After a step,
    the rewarded continuations gained log-probability and the others gained clearly less (or
    lost), under the weights the trainer publishes (what the rollout nodes load)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    model.eval()
    vocab = model.config.vocab_size
    rng = np.random.default_rng(7)
    prompt = [int(t) for t in rng.integers(5, vocab, 10)]
    conts = [[int(t) for t in rng.integers(5, vocab, 6)] for _ in range(4)]
    rewards = [1.0, 0.0, 1.0, 0.0]
    before = [_seq_logp(model, prompt + c, len(prompt)) for c in conts]
    trajs = []
    for i, (c, r) in enumerate(zip(conts, rewards, strict=True)):
        ids = prompt + c
        from rollcall.workers.trainer.forward import token_logprobs
        from rollcall.workers.trainer.packing import pack

        with torch.no_grad():
            lp, _ = token_logprobs(model, pack([ids]))
        mask = np.r_[np.zeros(len(prompt)), np.ones(len(c))].astype(np.uint8)
        logp = np.where(mask == 1, lp.numpy(), 0.0).astype(np.float32)  # the behaviour policy
        payload = TrajectoryPayload.build(
            np.array(ids), mask, logp, turn_offsets=[len(prompt)], turn_versions=[0]
        )
        trajs.append(BatchTrajectory(i, payload, r))
    batch = Batch(1, 0, (BatchGroup(0, 1, "calc", {}, 0, tuple(trajs)),), {}, False, {})
    loss = LossConfig.model_validate(STEP_LOSSES[kinds])
    config = TrainerConfig(ranks=1, lr=1e-3, loss=loss, micro_batch_tokens=64)
    group = TrainerGroup(config, str(tiny_dir), total_steps=1, seed=0)
    try:
        plan = plan_step(batch, loss, ranks=1, micro_batch_tokens=64)
        if "overlong" in kinds:  # 6 generated tokens, 2 into the buffer of 4: -0.5 each
            assert plan.metrics["overlong_penalty_mean"] == -0.5
        group.train(plan)
        published = Path(group.publish(str(tmp_path / "w"), 1))
    finally:
        group.shutdown()
    keys = model.load_state_dict(load_file(str(published / WEIGHTS_FILE)), strict=False)
    assert not keys.unexpected_keys and set(keys.missing_keys) <= {"lm_head.weight"}  # tied
    after = [_seq_logp(model, prompt + c, len(prompt)) for c in conts]
    delta = [a - b for a, b in zip(after, before, strict=True)]
    # rewarded: more likely; not rewarded: clearly less so (Adam's first update is close to
    # sign(grad) * lr for every parameter, so shared features can lift them a little too)
    assert min(delta[0], delta[2]) > 0.05, delta
    assert max(delta[1], delta[3]) < min(delta[0], delta[2]) - 0.05, delta


@pytest.mark.timeout(600)
def test_two_ranks_load_published_weights_newer_than_their_checkpoint(
    ray_local: Any, tiny_dir: Path, tmp_path: Path
) -> None:
    """A restart whose checkpoint is older than the last published version: each rank takes
    its shard of the published weights, the schedule moves to the version (the optimizer
    keeps the checkpoint's moments)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_dir).vocab_size
    config = _config(2).model_copy(update={"warmup_steps": 2, "schedule": "cosine"})
    group = TrainerGroup(config, str(tiny_dir), total_steps=5, seed=0)
    try:
        group.train(_plan(0, vocab, 2, LOSS))
        ckpt = group.save_checkpoint(str(tmp_path / "ckpt-0"), 0)  # version 1
        for step in (1, 2):
            group.train(_plan(step, vocab, 2, LOSS))
        published = group.publish(str(tmp_path / "weights"), 3)
        lr_next = group.train(_plan(3, vocab, 2, LOSS))["lr"]
    finally:
        group.shutdown()
    group = TrainerGroup(config, str(tiny_dir), total_steps=5, seed=0)
    try:
        group.load_checkpoint(ckpt)
        group.load_weights(published, 3)
        probe = _weights(group, tmp_path / "probe", 3)
        lr_resumed = group.train(_plan(3, vocab, 2, LOSS))["lr"]
    finally:
        group.shutdown()
    from safetensors.torch import load_file

    v3 = load_file(str(Path(published) / WEIGHTS_FILE))
    assert probe.keys() == v3.keys()
    for k in v3:
        torch.testing.assert_close(probe[k], v3[k], rtol=0, atol=0)
    assert lr_resumed == pytest.approx(lr_next)


@pytest.mark.timeout(900)
def test_chunked_checkpointed_and_bf16_steps_match_the_plain_step(
    ray_local: Any, tiny_dir: Path, tmp_path: Path
) -> None:
    """On two sharded ranks, one step (two optimizer updates) on the same batch: log-probs a
    few positions at a time, with activation checkpointing, train like whole-row log-probs; a
    bf16 step's loss is close to the float32 one's, and the weights stay float32."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_dir).vocab_size
    # GRPO's advantages add up to 0 per group, so its policy term nearly cancels (-1.1e-4 here):
    # an entropy bonus gives the loss a size (-0.06) that bf16 rounding is measured against.
    loss = LOSS.model_copy(update={"entropy_coef": 0.01})
    runs: dict[str, dict[str, Any]] = {
        "whole": {"logprob_chunk_tokens": 0},
        "chunked": {"logprob_chunk_tokens": 7, "activation_checkpointing": True},
        "bf16": {"logprob_chunk_tokens": 7, "precision": "bf16"},
    }
    metrics: dict[str, dict[str, Any]] = {}
    weights: dict[str, dict[str, torch.Tensor]] = {}
    for name, update in runs.items():
        config = _config(2).model_copy(update={"loss": loss, **update})
        group = TrainerGroup(config, str(tiny_dir), total_steps=1, seed=0)
        try:
            metrics[name] = group.train(_plan(0, vocab, 2, loss))
            weights[name] = _weights(group, tmp_path / name, 1)
        finally:
            group.shutdown()
    whole, chunked, bf16 = metrics["whole"], metrics["chunked"], metrics["bf16"]
    assert chunked["loss"] == pytest.approx(whole["loss"], rel=1e-5, abs=1e-6)
    assert chunked["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    for k in weights["whole"]:
        torch.testing.assert_close(weights["chunked"][k], weights["whole"][k], rtol=1e-4, atol=1e-5)
    # published in the dtype the forward computes with
    for name, w in weights.items():
        assert {t.dtype for t in w.values()} == {
            torch.bfloat16 if name == "bf16" else torch.float32
        }
    # bf16 rounding moved the loss by 2.1e-4 of itself and the gradient norm by 2.6e-4 (seen);
    # not at all would mean the step did not run in bf16
    gap = abs(bf16["loss"] - whole["loss"]) / abs(whole["loss"])
    assert 0 < gap < 2e-3
    assert bf16["grad_norm"] == pytest.approx(whole["grad_norm"], rel=2e-3)


@pytest.mark.timeout(600)
def test_a_bf16_trainer_publishes_bf16_that_engines_load(
    ray_local: Any, tiny_dir: Path, tmp_path: Path
) -> None:
    """``precision: bf16`` publishes bf16 tensors (half the float32 bytes); the hf engine loads
    them into float32 and into bf16 exactly, and a trainer loads them back."""
    from safetensors.torch import load_file

    from rollcall.workers.episode.engine import GenerationRequest
    from rollcall.workers.rollout.engines.hf import HFEngine
    from rollcall.workers.weights import read_metadata

    vocab = _vocab(tiny_dir)
    config = _config(1).model_copy(update={"precision": "bf16", "mini_batches": 1})
    group = TrainerGroup(config, str(tiny_dir), total_steps=2, seed=0)
    try:
        group.train(_plan(0, vocab, 1, LOSS))
        location = group.publish(str(tmp_path / "w"), 1)
        group.load_weights(location, 1)  # bf16 back into the float32 weights
        again = load_file(str(Path(group.publish(str(tmp_path / "again"), 1)) / WEIGHTS_FILE))
    finally:
        group.shutdown()
    published = load_file(str(Path(location) / WEIGHTS_FILE))
    assert {t.dtype for t in published.values()} == {torch.bfloat16}
    assert read_metadata(location)["dtype"] == "bfloat16"
    float32 = load_file(str(tiny_dir / "model.safetensors"))
    assert published.keys() == float32.keys() - {"lm_head.weight"}
    size, full = (
        (Path(location) / WEIGHTS_FILE).stat().st_size,
        sum(t.numel() * 4 for k, t in float32.items() if k in published),
    )
    assert 0.5 * full < size < 0.51 * full
    for k in published:
        assert torch.equal(again[k], published[k])
    for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        engine = HFEngine(tiny_dir, dtype=dtype)
        engine.load_weights(1, location)
        state = engine.model.state_dict()
        for k, t in published.items():
            assert state[k].dtype == torch_dtype
            assert torch.equal(state[k], t.to(torch_dtype)), k
        (gen,) = engine.generate([GenerationRequest([5, 6, 7], 8)])
        assert gen.version == 1 and len(gen.logprobs) > 0
        assert all(math.isfinite(lp) and lp <= 0 for lp in gen.logprobs)


def _vocab(model_dir: Path) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_dir).vocab_size)
