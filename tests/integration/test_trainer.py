"""The FSDP2 trainer on real Ray actors (gloo, CPU) and the tiny model: two ranks train like one,
and resuming from a checkpoint matches an uninterrupted run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from orchestrator.algorithms import LossConfig, SeqMeanTokenMean, TruncatedIS
from orchestrator.buffer.types import Batch, BatchGroup, BatchTrajectory, TrajectoryPayload
from orchestrator.config import TrainerConfig
from workers.trainer.batch import StepPlan, plan_step
from workers.trainer.group import TrainerGroup
from workers.trainer.weights import WEIGHTS_FILE


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
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=2e-6)

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
