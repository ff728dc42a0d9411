"""Values that cross the buffer's boundary: leases, claims, commit results and batches.

The values the database layer also returns (``TrajectoryPayload``, ``SampleState``,
``BatchGroup``, ``BatchTrajectory``) live in ``rollcall.orchestrator.domain``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollcall.orchestrator.domain import BatchGroup, SampleState

# Keys of a step's task mix (``jobs.pending_mix``, then ``train_steps.task_mix``) besides the
# per-task entries (keyed by task id): the extra claims of dynamic sampling.
DYNAMIC_CLAIMS = "dynamic_claims"


@dataclass(frozen=True)
class Lease:
    """A worker's hold on an episode; every write carries it and is fenced by its epoch."""

    episode_id: int
    task_id: int
    epoch: int
    worker_id: int


@dataclass(frozen=True)
class ClaimedEpisode:
    lease: Lease
    task_name: str
    plugin: str
    spec: dict[str, Any]
    prompt_index: int
    prompt: dict[str, Any]
    group_size: int
    attempts: int
    samples: tuple[SampleState, ...]
    # the job's published weights (version, location) as of the claim, read after the lease
    # was taken: a node loads them before rolling out, so nothing it generates for this claim
    # predates a version published before the episode could be claimed
    published_weights: tuple[int, str] | None = None

    @property
    def resumed(self) -> bool:
        return any(s.status != "new" for s in self.samples)


@dataclass(frozen=True)
class CommitResult:
    committed: tuple[int, ...]  # sample indexes newly committed
    already: tuple[int, ...]  # sample indexes that were committed before (idempotent re-commit)
    group_done: bool  # the episode's whole group is ready: the episode is done


@dataclass(frozen=True)
class Batch:
    step: int
    policy_version: int  # the version being trained (the weights before this step)
    groups: tuple[BatchGroup, ...]
    task_mix: dict[str, Any]  # per task: groups, target share, carry, shortfall
    replayed: bool  # the same batch as an earlier, uncommitted claim for this step
    expired_groups: dict[str, int]  # per task: groups expired (stale) while claiming
    prefetched_groups: int = 0  # groups read ahead (TrainerBuffer.prefetch_groups)
    shortfall: int = 0  # an empty batch (min_groups not met): how many groups it lacked

    @property
    def num_trajectories(self) -> int:
        return sum(len(g.trajectories) for g in self.groups)

    @property
    def dynamic_claims(self) -> int:
        """Extra claims of dynamic sampling that reserved groups into this step
        (``TrainerBuffer.extend_batch``)."""
        return int(self.task_mix.get(DYNAMIC_CLAIMS, 0))


@dataclass(frozen=True)
class SweepResult:
    requeued: int
    quarantined: int
    episode_ids: tuple[int, ...]
