"""From a claimed batch to the trainer ranks' work: advantages per group, per-token weights,
and the plan of micro-batches per rank. Pure: plain values in, plain values out.

A step's batch may be split into ``mini_batches`` optimizer updates (PPO's mini-batches); each
mini-batch's aggregation weights come from its own totals, so each update's loss is the mean
(in the configured sense) over that mini-batch, whatever the micro-batch and rank split.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from orchestrator.algorithms import LossConfig
from orchestrator.buffer.types import Batch
from workers.trainer.grpo import (
    StepTotals,
    advantage_stats,
    batch_advantages,
    sequence_scale,
    staleness,
)
from workers.trainer.packing import plan_micro_batches


@dataclass(frozen=True)
class TrainSequence:
    """One trajectory as the trainer sees it."""

    token_ids: np.ndarray[Any, np.dtype[np.int32]]  # [T]
    loss_mask: np.ndarray[Any, np.dtype[np.uint8]]  # [T]
    behaviour_logprobs: np.ndarray[Any, np.dtype[np.float32]]  # [T]
    advantage: float
    scale: float  # aggregation weight of each trained token
    task: str


@dataclass(frozen=True)
class StepPlan:
    """Per mini-batch, per rank, its micro-batches of sequences."""

    mini_batches: list[list[list[list[TrainSequence]]]]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def sequences(self) -> int:
        return sum(len(mb) for mini in self.mini_batches for rank in mini for mb in rank)


def plan_step(
    batch: Batch,
    loss: LossConfig,
    *,
    ranks: int,
    micro_batch_tokens: int,
    mini_batches: int = 1,
) -> StepPlan:
    """Advantages, weights and micro-batch plans for a claimed batch, with the batch metrics
    (per-task reward and advantage stats, degenerate groups, staleness)."""
    rewards = [[t.reward for t in g.trajectories] for g in batch.groups]
    adv = batch_advantages(rewards, loss.advantage, filter_degenerate=loss.filter_degenerate_groups)
    metrics: dict[str, float] = {
        "groups": float(len(batch.groups)),
        "groups_degenerate": float(adv.degenerate),
        "groups_filtered": float(adv.filtered),
        **staleness(
            batch.policy_version,
            [t.payload.turn_versions for g in batch.groups for t in g.trajectories],
        ),
    }
    by_task_rewards: dict[str, list[float]] = defaultdict(list)
    by_task_adv: dict[str, list[list[float]]] = defaultdict(list)
    for g, r in zip(batch.groups, rewards, strict=True):
        by_task_rewards[g.task_name] += r
    kept = [(batch.groups[i], a) for i, a in zip(adv.kept, adv.advantages, strict=True)]
    for g, a in kept:
        by_task_adv[g.task_name].append(a)
    for task, rs in sorted(by_task_rewards.items()):
        metrics[f"reward/{task}"] = sum(rs) / len(rs)
        metrics[f"samples/{task}"] = float(len(rs))
        metrics.update(advantage_stats(task, by_task_adv.get(task, [])))
    metrics["reward"] = sum(sum(r) for r in rewards) / max(1, sum(len(r) for r in rewards))

    count = max(1, min(mini_batches, len(kept)))
    chunks = [kept[i::count] for i in range(count)]
    plans = []
    for chunk in chunks:
        trajs = [(g, t, a) for g, advs in chunk for t, a in zip(g.trajectories, advs, strict=True)]
        trained = [int(t.payload.loss_mask.sum()) for _, t, _ in trajs]
        totals = StepTotals.of(trained)
        seqs = [
            TrainSequence(
                token_ids=t.payload.token_ids,
                loss_mask=t.payload.loss_mask,
                behaviour_logprobs=t.payload.behaviour_logprobs,
                advantage=a,
                scale=sequence_scale(loss.aggregation, n, totals),
                task=g.task_name,
            )
            for (g, t, a), n in zip(trajs, trained, strict=True)
        ]
        lengths = [len(s.token_ids) for s in seqs]
        plan = plan_micro_batches(lengths, micro_batch_tokens, ranks)
        plans.append([[[seqs[i] for i in mb] for mb in rank] for rank in plan])
    metrics["tokens"] = float(
        sum(len(t.payload.token_ids) for g in batch.groups for t in g.trajectories)
    )
    return StepPlan(plans, metrics)
