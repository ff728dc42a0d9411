"""Plain values shared by the database layer and everything above it.

Statuses are Python enums mirrored by PostgreSQL enum types (the database rejects any other
value). Repositories return the frozen views below, never ORM objects, so no caller outside
``rollcall.orchestrator.db`` holds a session-bound object.

Token payloads are stored as little-endian bytes: token ids int32, loss mask uint8, behaviour
log-probs float32, one entry per token. ``TrajectoryPayload`` checks their shapes once, where
it is built, so the database never holds a misaligned trajectory.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np
import numpy.typing as npt

# a rollout slot's states as the driver's supervisor sees them (``rollout_slots.state``,
# orchestrator/runner/supervisor.py)
SLOT_STATES = (
    "starting", "alive", "restarting", "awaiting_ray", "waiting_capacity", "draining", "failed",
    "removed",
)  # fmt: skip


class JobStatus(enum.StrEnum):
    """What the job's driver is doing: ``running`` from its set-up, ``stopping`` once asked to
    (``rollcall job stop``), then ``finished`` (``run.total_steps`` reached), ``stopped``
    (stopped before it; ``--resume`` continues) or ``failed`` (the driver failed). A driver
    that was killed leaves ``running``/``stopping`` behind without holding the job: whether
    a driver is alive is its lock's business (``JobRepository.driver_alive``)."""

    CREATED = "created"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FINISHED = "finished"
    FAILED = "failed"


class TaskStatus(enum.StrEnum):
    ACTIVE = "active"
    PAUSED = "paused"
    DRAINING = "draining"
    RETIRED = "retired"


class WorkerRole(enum.StrEnum):
    ROLLOUT = "rollout"
    TRAINER = "trainer"


class WorkerStatus(enum.StrEnum):
    STARTING = "starting"
    ALIVE = "alive"
    DEAD = "dead"
    FAILED = "failed"
    STOPPED = "stopped"


class EpisodeStatus(enum.StrEnum):
    QUEUED = "queued"
    LEASED = "leased"
    DONE = "done"
    EXPIRED = "expired"
    QUARANTINED = "quarantined"


class TrajectoryStatus(enum.StrEnum):
    IN_PROGRESS = "in_progress"
    READY = "ready"
    CLAIMED = "claimed"
    CONSUMED = "consumed"
    EXPIRED = "expired"


@dataclass(frozen=True)
class JobView:
    id: int
    name: str
    status: JobStatus
    policy_version: int
    config: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    # Bumped by every driver that takes the job; step commits are fenced by it.
    driver_epoch: int = 0
    # The latest driver that took the job: pid, host, actor, started_at.
    driver: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "status": self.status.value,
            "policy_version": self.policy_version,
            "driver_epoch": self.driver_epoch,
            "config": self.config,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
        }


@dataclass(frozen=True)
class TaskView:
    id: int
    job_id: int
    job_name: str
    name: str
    plugin: str
    spec: dict[str, Any]
    weight: float
    max_inflight: int
    max_staleness: int
    status: TaskStatus
    partition: str
    prompt_cursor: int
    created_at: datetime
    updated_at: datetime
    retired_at: datetime | None
    counters: dict[str, int] = field(default_factory=dict)
    status_reason: str | None = None  # why it is paused, when the user-code guard paused it

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "job": self.job_name,
            "name": self.name,
            "plugin": self.plugin,
            "spec": self.spec,
            "weight": self.weight,
            "max_inflight": self.max_inflight,
            "max_staleness": self.max_staleness,
            "status": self.status.value,
            "partition": self.partition,
            "prompt_cursor": self.prompt_cursor,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
            "retired_at": self.retired_at.isoformat() if self.retired_at else None,
            "counters": self.counters,
            "status_reason": self.status_reason,
        }


def paused_sentence(task: str, job: str, reason: str) -> str:
    """What an operator reads about a task the user-code guard paused: why, and how to go on."""
    return (
        f"task {task!r} paused: {reason}; fix the code, then `rollcall task resume {task} "
        f"--job {job}` (rollout nodes load the fixed code when they start: `rollcall run CONFIG "
        "--resume`)"
    )


@dataclass(frozen=True)
class TaskCounts:
    """Work of one task by status, for ``task show``."""

    episodes: dict[str, int] = field(default_factory=dict)
    trajectories: dict[str, int] = field(default_factory=dict)
    partition_attached: bool = False


@dataclass(frozen=True)
class EventView:
    id: int
    kind: str
    actor: str
    message: str
    job_id: int | None
    task_id: int | None
    payload: dict[str, Any]
    created_at: datetime

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "actor": self.actor,
            "message": self.message,
            "job_id": self.job_id,
            "task_id": self.task_id,
            "payload": self.payload,
            "created_at": self.created_at.isoformat(),
        }


TOKEN_DTYPE = np.dtype("<i4")
MASK_DTYPE = np.dtype("<u1")
LOGPROB_DTYPE = np.dtype("<f4")


def encode(values: Any, dtype: np.dtype[Any]) -> bytes:
    return np.ascontiguousarray(np.asarray(values, dtype=dtype)).tobytes()


def decode(raw: bytes, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    return np.frombuffer(raw, dtype=dtype).copy()


# An agent's record of calls (``workers/episode``) in a payload's ``env_state["state"]``: JOURNAL
# holds the entries, JOURNAL_STORED how many of the first ones its writer knows are stored. With
# the mark, a write stores only the entries past it (``agent_journal`` rows, migration 0008) and
# a read puts the whole journal back under JOURNAL; without it the state is stored as it is.
JOURNAL = "journal"
JOURNAL_STORED = "journal_stored"


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

    def encoded(self, start: int = 0) -> dict[str, Any]:
        """Column values for the ``trajectories`` table, with the payload's tokens from
        ``start`` on (a ``trajectory_segments`` row)."""
        return {
            "token_ids": encode(self.token_ids[start:], TOKEN_DTYPE),
            "loss_mask": encode(self.loss_mask[start:], MASK_DTYPE),
            "behaviour_logprobs": encode(self.behaviour_logprobs[start:], LOGPROB_DTYPE),
            "num_tokens": self.num_tokens,
            "prompt_tokens": self.prompt_tokens,
            "num_turns": len(self.turn_offsets),
            "turn_offsets": list(self.turn_offsets),
            "turn_versions": list(self.turn_versions),
            "min_policy_version": self.min_version,
            "env_state": self.env_state,
            "finished": self.finished,
        }

    def extends(self, prefix: TrajectoryPayload) -> bool:
        """Whether this payload's first tokens are exactly ``prefix``'s (mask and log-probs
        too): then only the tokens past them are new."""
        n = prefix.num_tokens
        return (
            n <= self.num_tokens
            and np.array_equal(self.token_ids[:n], prefix.token_ids)
            and np.array_equal(self.loss_mask[:n], prefix.loss_mask)
            and np.array_equal(self.behaviour_logprobs[:n], prefix.behaviour_logprobs)
        )

    @classmethod
    def from_columns(
        cls, row: Any, token_ids: bytes, loss_mask: bytes, behaviour_logprobs: bytes
    ) -> TrajectoryPayload:
        """A payload from a ``trajectories`` row and its segments' bytes, concatenated."""
        return cls(
            token_ids=decode(token_ids, TOKEN_DTYPE),
            loss_mask=decode(loss_mask, MASK_DTYPE),
            behaviour_logprobs=decode(behaviour_logprobs, LOGPROB_DTYPE),
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
class SampleState:
    """Where one sample of a claimed group stands: ``new``, ``in_progress`` (resume from
    ``checkpoint``) or ``ready`` (already committed; nothing to do)."""

    sample_index: int
    status: str
    checkpoint: TrajectoryPayload | None = None


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
