"""The theoretical throughput of ``pipeline.py``'s configurations: each mode's bound from the
trajectory profile a dry run measured (the derivation is in RESULTS.md, "The bounds")."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ops.bench.pipeline import Setup


@dataclass(frozen=True)
class Sample:
    seconds: float  # simulated seconds of the trajectory (generation + tools)
    tokens: int
    turns: int


@dataclass
class Bounds:
    traj_s: float  # mean simulated seconds of a trajectory (all tasks, claim mix)
    group_span_s: float  # mean simulated seconds from a group's claim to its completion
    batch_tokens: float
    sync_rollout_s: float  # E[time to roll out a full batch], sync
    train_s: float  # modelled trainer time of one step (train + checkpoint + publish)
    load_s: float
    sync_step_s: float
    sync_traj_per_s: float  # bound, simulated seconds
    trainer_traj_per_s: float
    rollout_traj_per_s: float
    admission_traj_per_s: float
    async_traj_per_s: float
    async_limited_by: str


def group_span(samples: list[Sample], rng: random.Random, group: int, parallel: bool) -> float:
    draws = [rng.choice(samples).seconds for _ in range(group)]
    return max(draws) if parallel else sum(draws)


def compute_bounds(
    setup: Setup,
    profile: dict[str, list[Sample]],
    parallel: bool,
    mix: dict[str, float] | None = None,
    train_s: float | None = None,
) -> Bounds:
    """The pipeline's theoretical throughput for this configuration (see RESULTS.md). ``mix``:
    the share of each task among the trajectories (default: equal, as the weights ask; a run's
    realized mix differs when a task falls short and the others fill its batch slots).
    ``train_s``: the modelled step time of the batches a run actually trained in its window,
    in place of the profile's. Their tokens differ from the profile's mean, most in short runs:
    the first batches are made of the groups that finish first (the short ones, before the
    window), so the window trains more than its share of the long ones."""
    rng = random.Random(7)
    names = list(profile)
    share_of = mix or {n: 1 / len(names) for n in names}
    b, g = setup.batch_groups, setup.group_size
    traj_s = sum(
        share_of.get(n, 0.0) * statistics.mean(x.seconds for x in profile[n]) for n in names
    )
    tokens = sum(
        share_of.get(n, 0.0) * statistics.mean(x.tokens for x in profile[n]) for n in names
    )
    trials = 2000
    weights = [share_of.get(n, 0.0) for n in names]
    span = statistics.mean(
        group_span(profile[rng.choices(names, weights)[0]], rng, g, parallel) for _ in range(trials)
    )
    # Sync: every task's admission cap is ceil(batch share); those groups start together and
    # the batch is complete when the first B of them are done (loops permitting).
    share = b / len(names)
    admitted = {n: max(1, math.ceil(share - 1e-9)) for n in names}
    loops = setup.nodes * setup.concurrency
    rollouts = []
    for _ in range(trials):
        spans = sorted(
            group_span(profile[n], rng, g, parallel) for n in names for _ in range(admitted[n])
        )
        waves = max(1, math.ceil(min(len(spans), b) * (g if parallel else 1) / loops))
        rollouts.append(spans[b - 1] * waves if len(spans) >= b else spans[-1] * waves)
    sync_rollout = statistics.mean(rollouts)
    t = setup.trainer_config()
    from rollcall.workers.trainer.timing import step_seconds

    train = (
        step_seconds(t, round(tokens * b * g)) + t.checkpoint_s + t.publish_s
        if train_s is None
        else train_s
    )
    load = setup.engine_config().load_s
    sync_step = sync_rollout + train + load
    per_batch = b * g
    trainer_rate = per_batch / train
    rollout_rate = loops / traj_s
    # Admission: outstanding groups (queued + leased + finished, untrained) per task within
    # ceil((k + 1) x share); about one batch of them is finished and waiting for the trainer.
    outstanding = sum(max(1, math.ceil((setup.max_staleness + 1) * share - 1e-9)) for _ in names)
    admission_rate = max(0, outstanding - b) * g / span
    async_rate = min(trainer_rate, rollout_rate, admission_rate)
    limited = {trainer_rate: "trainer", rollout_rate: "rollout loops", admission_rate: "admission"}
    return Bounds(
        traj_s=traj_s,
        group_span_s=span,
        batch_tokens=tokens * per_batch,
        sync_rollout_s=sync_rollout,
        train_s=train,
        load_s=load,
        sync_step_s=sync_step,
        sync_traj_per_s=per_batch / sync_step,
        trainer_traj_per_s=trainer_rate,
        rollout_traj_per_s=rollout_rate,
        admission_traj_per_s=admission_rate,
        async_traj_per_s=async_rate,
        async_limited_by=limited[async_rate],
    )


def mode_bound(b: Bounds, mode: str) -> float:
    return b.sync_traj_per_s if mode == "sync" else b.async_traj_per_s
