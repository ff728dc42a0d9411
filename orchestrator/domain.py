"""Plain values shared by the database layer and everything above it.

Statuses are Python enums mirrored by PostgreSQL enum types (the database rejects any other
value). Repositories return the frozen views below, never ORM objects, so no caller outside
``orchestrator.db`` holds a session-bound object.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


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
        }


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
