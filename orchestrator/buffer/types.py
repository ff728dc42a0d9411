"""Values that cross the buffer's boundary: trajectory payloads, leases, claims and batches.

Token payloads are stored as little-endian bytes: token ids int32, loss mask uint8, behaviour
log-probs float32, one entry per token. ``TrajectoryPayload`` checks their shapes once, where
it is built, so the database never holds a misaligned trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

TOKEN_DTYPE = np.dtype("<i4")
MASK_DTYPE = np.dtype("<u1")
LOGPROB_DTYPE = np.dtype("<f4")


def encode(values: Any, dtype: np.dtype[Any]) -> bytes:
    return np.ascontiguousarray(np.asarray(values, dtype=dtype)).tobytes()


def decode(raw: bytes, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    return np.frombuffer(raw, dtype=dtype).copy()


@dataclass(frozen=True)
class TrajectoryPayload:
    """One trajectory's tokens so far (token-in/token-out) and the state to resume it."""

    token_ids: npt.NDArray[np.int32]  # [T]
    loss_mask: npt.NDArray[np.uint8]  # [T] 1 = generated (trained on), 0 = prompt / tool output
    behaviour_logprobs: npt.NDArray[
        np.float32
    ]  # [T] log-prob of each token under the behaviour policy
    turn_offsets: tuple[int, ...] = ()  # token index where each turn starts
    turn_versions: tuple[int, ...] = ()  # policy version that generated each turn
    prompt_tokens: int = 0
    env_state: dict[str, Any] = field(default_factory=dict)
    finished: bool = False

    @classmethod
    def build(
        cls,
        token_ids: Any,
        loss_mask: Any,
        behaviour_logprobs: Any,
        *,
        turn_offsets: Any = (),
        turn_versions: Any = (),
        prompt_tokens: int = 0,
        env_state: dict[str, Any] | None = None,
        finished: bool = False,
    ) -> TrajectoryPayload:
        p = cls(
            token_ids=np.asarray(token_ids, dtype=TOKEN_DTYPE),
            loss_mask=np.asarray(loss_mask, dtype=MASK_DTYPE),
            behaviour_logprobs=np.asarray(behaviour_logprobs, dtype=LOGPROB_DTYPE),
            turn_offsets=tuple(int(x) for x in turn_offsets),
            turn_versions=tuple(int(x) for x in turn_versions),
            prompt_tokens=int(prompt_tokens),
            env_state=dict(env_state or {}),
            finished=finished,
        )
        p.validate()
        return p

    def validate(self) -> None:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.behaviour_logprobs) != n:
            raise ValueError(
                f"payload arrays differ in length: tokens {n}, mask {len(self.loss_mask)}, "
                f"logprobs {len(self.behaviour_logprobs)}"
            )
        if len(self.turn_offsets) != len(self.turn_versions):
            raise ValueError("turn_offsets and turn_versions must have one entry per turn")
        if any(b <= a for a, b in zip(self.turn_offsets, self.turn_offsets[1:], strict=False)):
            raise ValueError("turn_offsets must be strictly increasing")
        if self.turn_offsets and not (self.turn_offsets[0] >= 0 and self.turn_offsets[-1] <= n):
            raise ValueError("turn_offsets must lie within the trajectory")
        if n and int(self.loss_mask.max()) > 1:
            raise ValueError("loss_mask holds 0 or 1 only")
        if not 0 <= self.prompt_tokens <= n:
            raise ValueError("prompt_tokens must lie within the trajectory")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def min_version(self) -> int | None:
        return min(self.turn_versions) if self.turn_versions else None

    def encoded(self) -> dict[str, Any]:
        """Column values for the ``trajectories`` table."""
        return {
            "token_ids": encode(self.token_ids, TOKEN_DTYPE),
            "loss_mask": encode(self.loss_mask, MASK_DTYPE),
            "behaviour_logprobs": encode(self.behaviour_logprobs, LOGPROB_DTYPE),
            "num_tokens": self.num_tokens,
            "prompt_tokens": self.prompt_tokens,
            "num_turns": len(self.turn_offsets),
            "turn_offsets": list(self.turn_offsets),
            "turn_versions": list(self.turn_versions),
            "min_policy_version": self.min_version,
            "env_state": self.env_state,
            "finished": self.finished,
        }

    @classmethod
    def from_columns(cls, row: Any) -> TrajectoryPayload:
        return cls(
            token_ids=decode(row.token_ids, TOKEN_DTYPE),
            loss_mask=decode(row.loss_mask, MASK_DTYPE),
            behaviour_logprobs=decode(row.behaviour_logprobs, LOGPROB_DTYPE),
            turn_offsets=tuple(row.turn_offsets or ()),
            turn_versions=tuple(row.turn_versions or ()),
            prompt_tokens=row.prompt_tokens,
            env_state=dict(row.env_state or {}),
            finished=row.finished,
        )

    def same_as(self, other: TrajectoryPayload) -> bool:
        return (
            np.array_equal(self.token_ids, other.token_ids)
            and np.array_equal(self.loss_mask, other.loss_mask)
            and np.array_equal(self.behaviour_logprobs, other.behaviour_logprobs)
            and self.turn_offsets == other.turn_offsets
            and self.turn_versions == other.turn_versions
            and self.prompt_tokens == other.prompt_tokens
            and self.env_state == other.env_state
            and self.finished == other.finished
        )


@dataclass(frozen=True)
class Lease:
    """A worker's hold on an episode; every write carries it and is fenced by its epoch."""

    episode_id: int
    task_id: int
    epoch: int
    worker_id: int


@dataclass(frozen=True)
class SampleState:
    """Where one sample of a claimed group stands: ``new``, ``in_progress`` (resume from
    ``checkpoint``) or ``ready`` (already committed; nothing to do)."""

    sample_index: int
    status: str
    checkpoint: TrajectoryPayload | None = None


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
class BatchTrajectory:
    sample_index: int
    payload: TrajectoryPayload
    reward: float


@dataclass(frozen=True)
class BatchGroup:
    episode_id: int
    task_id: int
    task_name: str
    prompt: dict[str, Any]
    min_policy_version: int
    trajectories: tuple[BatchTrajectory, ...]


@dataclass(frozen=True)
class Batch:
    step: int
    policy_version: int  # the version being trained (the weights before this step)
    groups: tuple[BatchGroup, ...]
    task_mix: dict[str, Any]  # per task: groups, target share, carry, shortfall
    replayed: bool  # the same batch as an earlier, uncommitted claim for this step
    expired_groups: dict[str, int]  # per task: groups expired (stale) while claiming
    prefetched_groups: int = 0  # groups whose samples were read ahead (Buffer.prefetch_groups)
    shortfall: int = 0  # an empty batch (min_groups not met): how many groups it lacked

    @property
    def num_trajectories(self) -> int:
        return sum(len(g.trajectories) for g in self.groups)


@dataclass(frozen=True)
class SweepResult:
    requeued: int
    quarantined: int
    episode_ids: tuple[int, ...]
