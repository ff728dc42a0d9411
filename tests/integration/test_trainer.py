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


# The runs the tests below share (each TrainerGroup start is a set of Ray actors loading
# torch and the model): two ranks on a warmup and cosine schedule, with an entropy bonus (GRPO's
# advantages add up to 0 per group, so its policy term nearly cancels, -1.1e-4 here: the bonus
# gives the loss a size, -0.06, that bf16 rounding is measured against), whole-row log-probs.
LOSS_E = LOSS.model_copy(update={"entropy_coef": 0.01})
TOTAL = 5  # steps each group's schedule is made for


def _config2(ranks: int = 2, **update: Any) -> TrainerConfig:
    return _config(ranks).model_copy(
        update={
            "loss": LOSS_E,
            "warmup_steps": 2,
            "schedule": "cosine",
            "logprob_chunk_tokens": 0,
            **update,
        }
    )


@pytest.fixture(scope="module")
def runs(ray_local: Any, tiny_dir: Path, tmp_path_factory: Any) -> dict[str, Any]:
    """1 rank and 2 ranks, 3 steps each (2 optimizer updates per step), same data; the 2-rank
    one checkpoints after steps 0 and 1, publishes versions 1 and 3 and trains a step 3. Then
    a fresh 2-rank trainer resumes from the checkpoint after step 1 and trains step 2; then
    it restarts from the checkpoint after step 0 with the newer published version 3."""
    tmp = tmp_path_factory.mktemp("trainer")
    vocab = _vocab(tiny_dir)
    out: dict[str, Any] = {"tmp": tmp, "vocab": vocab}
    for ranks in (1, 2):
        group = TrainerGroup(_config2(ranks), str(tiny_dir), total_steps=TOTAL, seed=0)
        try:
            for step in range(3):
                plan = _plan(step, vocab, ranks, LOSS_E)
                assert len({len(m) for m in plan.mini_batches[0]}) == 1  # same count per rank
                metrics = group.train(plan)
                assert metrics["tokens"] > 0 and np.isfinite(metrics["loss"])
                if ranks == 2 and step == 0:
                    out["whole"] = metrics
                    out["whole_weights"] = _weights(group, tmp / "whole", 1)
                if ranks == 2 and step in (0, 1):
                    out[f"ckpt{step}"] = group.save_checkpoint(str(tmp / f"ckpt-{step}"), step)
            out[f"ranks{ranks}"] = _weights(group, tmp / f"w{ranks}", 3)
            if ranks == 2:
                out["published"] = str(Path(group.publish(str(tmp / "weights"), 3)))
                out["lr_next"] = group.train(_plan(3, vocab, 2, LOSS_E))["lr"]
        finally:
            group.shutdown()
    group = TrainerGroup(_config2(), str(tiny_dir), total_steps=TOTAL, seed=0)
    try:
        # Resume: a fresh trainer loads the checkpoint after step 1 and trains step 2.
        out["resumed_step"] = group.load_checkpoint(out["ckpt1"])
        group.train(_plan(2, vocab, 2, LOSS_E))
        out["resumed"] = _weights(group, tmp / "w-resumed", 3)
        # A restart whose checkpoint (after step 0: version 1) is older than the last
        # published version (3).
        group.load_checkpoint(out["ckpt0"])
        group.load_weights(out["published"], 3)
        out["probe"] = _weights(group, tmp / "probe", 3)
        out["lr_resumed"] = group.train(_plan(3, vocab, 2, LOSS_E))["lr"]
    finally:
        group.shutdown()
    return out


@pytest.mark.timeout(900)
def test_two_ranks_train_like_one_and_resume_matches(runs: dict[str, Any], tiny_dir: Path) -> None:
    from safetensors.torch import load_file

    start = load_file(str(tiny_dir / "model.safetensors"))
    one, two = runs["ranks1"], runs["ranks2"]
    moved = max(float((one[k] - start[k]).abs().max()) for k in one)
    assert moved > 1e-3  # training changed the weights
    # Two ranks reduce gradients in another order: float rounding differs (2.1e-6 seen after
    # six AdamW updates at lr 1e-3), a hundred times below how far training moved the weights.
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=1e-5)
    # Resumed from the checkpoint after step 1, step 2 gives the uninterrupted run's weights.
    assert runs["resumed_step"] == 1
    for k in two:
        torch.testing.assert_close(runs["resumed"][k], two[k], rtol=0, atol=0)


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


def test_two_ranks_load_published_weights_newer_than_their_checkpoint(
    runs: dict[str, Any],
) -> None:
    """A restart whose checkpoint is older than the last published version: each rank takes
    its shard of the published weights, the schedule moves to the version (the optimizer
    keeps the checkpoint's moments)."""
    from safetensors.torch import load_file

    probe = runs["probe"]
    v3 = load_file(str(Path(runs["published"]) / WEIGHTS_FILE))
    assert probe.keys() == v3.keys()
    for k in v3:
        torch.testing.assert_close(probe[k], v3[k], rtol=0, atol=0)
    assert runs["lr_resumed"] == pytest.approx(runs["lr_next"])


@pytest.fixture(scope="module")
def variants(runs: dict[str, Any], tiny_dir: Path) -> dict[str, Any]:
    """Step 0 of the shared 2-rank run again, with log-probs a few positions at a time and
    activation checkpointing, and in bf16 (whose publication is loaded back too)."""
    tmp, vocab = runs["tmp"], runs["vocab"]
    out: dict[str, Any] = {"metrics": {"whole": runs["whole"]}}
    out["weights"] = {"whole": runs["whole_weights"]}
    updates: dict[str, dict[str, Any]] = {
        "chunked": {"logprob_chunk_tokens": 7, "activation_checkpointing": True},
        "bf16": {"logprob_chunk_tokens": 7, "precision": "bf16"},
    }
    for name, update in updates.items():
        group = TrainerGroup(_config2(**update), str(tiny_dir), total_steps=TOTAL, seed=0)
        try:
            out["metrics"][name] = group.train(_plan(0, vocab, 2, LOSS_E))
            location = group.publish(str(tmp / name), 1)
            out["weights"][name] = load_file_of(location)
            if name == "bf16":
                out["bf16_location"] = location
                group.load_weights(location, 1)  # bf16 back into the float32 weights
                out["bf16_again"] = _weights(group, tmp / "again", 1)
        finally:
            group.shutdown()
    return out


def load_file_of(location: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(location) / WEIGHTS_FILE))


@pytest.mark.timeout(600)
def test_chunked_checkpointed_and_bf16_steps_match_the_plain_step(
    variants: dict[str, Any],
) -> None:
    """On two sharded ranks, one step (two optimizer updates) on the same batch: log-probs a
    few positions at a time, with activation checkpointing, train like whole-row log-probs; a
    bf16 step's loss is close to the float32 one's, and the weights stay float32."""
    metrics, weights = variants["metrics"], variants["weights"]
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
    variants: dict[str, Any], tiny_dir: Path
) -> None:
    """``precision: bf16`` publishes bf16 tensors (half the float32 bytes); the hf engine loads
    them into float32 and into bf16 exactly, and a trainer loads them back."""
    from safetensors.torch import load_file

    from rollcall.workers.episode.engine import GenerationRequest
    from rollcall.workers.rollout.engines.hf import HFEngine
    from rollcall.workers.weights import read_metadata

    location, again = variants["bf16_location"], variants["bf16_again"]
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
