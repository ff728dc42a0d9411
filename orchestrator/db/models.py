"""SQLAlchemy models of the control plane (the data model of docs/architecture.md; the whole
schema at head, its SQL functions included: orchestrator/db/schema.sql).

- Statuses are PostgreSQL enum types; quotas carry CHECK constraints, so the database itself
  refuses values the CLI would refuse.
- Timestamps come from the database clock (``now()``), never from a worker's clock.
- ``trajectories`` is ``PARTITION BY LIST (task_id)``: one partition per registered task,
  attached by registration and detached by retirement (SQL functions,
  ``rollcall_attach_task_partition`` / ``rollcall_detach_task_partition``). Token payloads are
  compact bytes: token ids int32, loss mask uint8, behaviour log-probs float32, all
  little-endian (see ``orchestrator.payload``); per-turn policy versions and turn offsets are
  integer arrays.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Double,
    Enum,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from rollcall.orchestrator.domain import (
    SLOT_STATES,
    EpisodeStatus,
    JobStatus,
    TaskStatus,
    TrajectoryStatus,
    WorkerRole,
    WorkerStatus,
)

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

TRAJECTORY_PARTITION_PREFIX = "trajectories_t"


def partition_name(task_id: int) -> str:
    return f"{TRAJECTORY_PARTITION_PREFIX}{task_id}"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {dict[str, Any]: JSONB}


def _enum(py_enum: type, name: str) -> Enum:
    return Enum(
        py_enum,
        name=name,
        values_callable=lambda e: [m.value for m in e],
        validate_strings=True,
    )


def _created() -> Mapped[datetime]:
    return mapped_column(DateTime(timezone=True), server_default=func.now(), nullable=False)


def _updated() -> Mapped[datetime]:
    return mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now(), nullable=False
    )


def _counter() -> Mapped[int]:
    return mapped_column(BigInteger, nullable=False, server_default="0")


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(63), nullable=False, unique=True)
    status: Mapped[JobStatus] = mapped_column(
        _enum(JobStatus, "job_status"), nullable=False, server_default=JobStatus.CREATED.value
    )
    config: Mapped[dict[str, Any]] = mapped_column(
        JSONB, nullable=False, server_default=text("'{}'::jsonb")
    )
    policy_version: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    # The train step whose batch is claimed but not committed, and its planned task mix (so a
    # restarted trainer replays exactly the same batch).
    pending_step: Mapped[int | None] = mapped_column(Integer)
    pending_mix: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    # The latest published weights (set with the step commit that produced them): rollout
    # nodes load ``weights_uri`` when ``weights_version`` is newer than what they hold.
    weights_version: Mapped[int | None] = mapped_column(Integer)
    weights_uri: Mapped[str | None] = mapped_column(Text)
    # One driver per job: every driver that takes the job (holding its advisory lock, see
    # ``rollcall.orchestrator.db.driver_lock``) bumps the epoch; step commits are fenced by it, so a
    # driver that lost the job cannot commit even where the lock was lost with a restart.
    driver_epoch: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    driver: Mapped[dict[str, Any] | None] = mapped_column(JSONB)  # pid, host, started_at
    created_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = _updated()
    # The rollout nodes the running job should have: the config's at start, then what an
    # operator set with ``rollcall job scale`` (the supervisor adds or drains slots to match).
    rollout_nodes: Mapped[int | None] = mapped_column(Integer)

    __table_args__ = (
        CheckConstraint("policy_version >= 0", name="policy_version_nonneg"),
        CheckConstraint("rollout_nodes IS NULL OR rollout_nodes >= 1", name="rollout_nodes_min"),
        CheckConstraint(
            "weights_version IS NULL OR weights_version >= 0", name="weights_version_nonneg"
        ),
    )


class Task(Base):
    __tablename__ = "tasks"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="RESTRICT"), nullable=False)
    name: Mapped[str] = mapped_column(String(63), nullable=False)
    plugin: Mapped[str] = mapped_column(String(200), nullable=False)
    spec: Mapped[dict[str, Any]] = mapped_column(
        JSONB, nullable=False, server_default=text("'{}'::jsonb")
    )
    weight: Mapped[float] = mapped_column(Double, nullable=False)
    max_inflight: Mapped[int] = mapped_column(Integer, nullable=False)
    max_staleness: Mapped[int] = mapped_column(Integer, nullable=False)
    status: Mapped[TaskStatus] = mapped_column(
        _enum(TaskStatus, "task_status"), nullable=False, server_default=TaskStatus.ACTIVE.value
    )
    # Position in the plugin's prompt stream: the next prompt index to seed (persisted so a
    # restart neither repeats nor skips prompts).
    prompt_cursor: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    # Counters of the buffer's exceptional paths (monotonic).
    fenced_rejections: Mapped[int] = _counter()
    expired_groups: Mapped[int] = _counter()
    quarantined_episodes: Mapped[int] = _counter()
    requeued_leases: Mapped[int] = _counter()
    # Exponentially decayed count of recent claims (weighted fair share of rollout claims).
    claim_score: Mapped[float] = mapped_column(Double, nullable=False, server_default="0")
    claim_score_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), nullable=False
    )
    created_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = _updated()
    retired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Why the task has its status, when not an operator's plain action (the user-code guard's
    # sentence for a task it paused); cleared when the task is resumed.
    status_reason: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        CheckConstraint("weight > 0", name="weight_positive"),
        CheckConstraint("max_inflight >= 1", name="max_inflight_min"),
        CheckConstraint("max_staleness >= 0", name="max_staleness_nonneg"),
        CheckConstraint("prompt_cursor >= 0", name="prompt_cursor_nonneg"),
        # A name is unique among a job's live tasks; a retired task frees its name.
        Index(
            "uq_tasks_job_id_name_live",
            "job_id",
            "name",
            unique=True,
            postgresql_where=text("status <> 'retired'"),
        ),
    )


class Worker(Base):
    __tablename__ = "workers"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="RESTRICT"), nullable=False)
    role: Mapped[WorkerRole] = mapped_column(_enum(WorkerRole, "worker_role"), nullable=False)
    # Stable slot name (``rollout-0``); each restart is a new row (incarnation) of the slot.
    name: Mapped[str] = mapped_column(String(63), nullable=False)
    incarnation: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    status: Mapped[WorkerStatus] = mapped_column(
        _enum(WorkerStatus, "worker_status"),
        nullable=False,
        server_default=WorkerStatus.STARTING.value,
    )
    host: Mapped[str | None] = mapped_column(String(255))
    pid: Mapped[int | None] = mapped_column(Integer)
    node_id: Mapped[str | None] = mapped_column(String(128))
    started_at: Mapped[datetime] = _created()
    last_heartbeat_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), nullable=False
    )
    last_progress_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), nullable=False
    )
    tokens_generated: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    restarts: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    loaded_version: Mapped[int | None] = mapped_column(Integer)
    stopped_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    info: Mapped[dict[str, Any]] = mapped_column(
        JSONB, nullable=False, server_default=text("'{}'::jsonb")
    )
    # Why it was declared dead (the sweep's reason, a tripped breaker, a failed engine).
    status_reason: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        UniqueConstraint("job_id", "name", "incarnation"),
        Index("ix_workers_job_id_status", "job_id", "status"),
    )


class RolloutSlot(Base):
    """One rollout node slot of a job as the driver's supervisor sees it (its incarnations are
    ``workers`` rows of the same name): its state since when, the Ray node its reservation is
    placed on, its restarts counted against the budget (within the window) and the machine
    losses that were not counted, and why it is in its state."""

    __tablename__ = "rollout_slots"

    job_id: Mapped[int] = mapped_column(
        ForeignKey("jobs.id", ondelete="RESTRICT"), primary_key=True
    )
    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    state: Mapped[str] = mapped_column(String(32), nullable=False)
    state_since: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), nullable=False
    )
    ray_node_id: Mapped[str | None] = mapped_column(String(128))
    restarts: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    max_restarts: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    machine_losses: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    reason: Mapped[str | None] = mapped_column(Text)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), nullable=False
    )

    __table_args__ = (
        CheckConstraint(
            "state IN (" + ", ".join(f"'{s}'" for s in SLOT_STATES) + ")", name="state"
        ),
    )


class Episode(Base):
    __tablename__ = "episodes"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="RESTRICT"), nullable=False)
    task_id: Mapped[int] = mapped_column(
        ForeignKey("tasks.id", ondelete="RESTRICT"), nullable=False
    )
    prompt_index: Mapped[int] = mapped_column(BigInteger, nullable=False)
    prompt: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    group_size: Mapped[int] = mapped_column(Integer, nullable=False)
    status: Mapped[EpisodeStatus] = mapped_column(
        _enum(EpisodeStatus, "episode_status"),
        nullable=False,
        server_default=EpisodeStatus.QUEUED.value,
    )
    lease_owner: Mapped[int | None] = mapped_column(ForeignKey("workers.id", ondelete="RESTRICT"))
    lease_epoch: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    leased_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    # Set when this episode re-generates the prompt of an expired one.
    requeued_from: Mapped[int | None] = mapped_column(
        ForeignKey("episodes.id", ondelete="SET NULL")
    )
    last_error: Mapped[str | None] = mapped_column(Text)
    # Oldest policy version among the group's samples, set when the group completes.
    min_policy_version: Mapped[int | None] = mapped_column(Integer)
    # The train step that reserved this group, and the step that consumed it.
    claimed_step: Mapped[int | None] = mapped_column(Integer)
    consumed_step: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = _updated()
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # User code failed on the episode's input: not claimable before ``retry_at`` (backoff), nor
    # by the worker it failed on (``failed_worker``) before ``failed_worker_retry_at``.
    retry_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    failed_worker: Mapped[int | None] = mapped_column(BigInteger)
    failed_worker_retry_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        CheckConstraint("group_size >= 1", name="group_size_min"),
        CheckConstraint("attempts >= 0", name="attempts_nonneg"),
        CheckConstraint(
            "(status = 'leased') = (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)",
            name="lease_iff_leased",
        ),
        Index("ix_episodes_task_id_status", "task_id", "status"),
        Index("ix_episodes_job_id_status", "job_id", "status"),
        Index("ix_episodes_queued", "task_id", "id", postgresql_where=text("status = 'queued'")),
        Index("ix_episodes_lease_owner", "lease_owner", postgresql_where=text("status = 'leased'")),
        Index("ix_episodes_task_id_leased_at", "task_id", "leased_at"),
        Index(
            "ix_episodes_ready",
            "task_id",
            "finished_at",
            postgresql_where=text("status = 'done' AND consumed_step IS NULL"),
        ),
        Index(
            "ix_episodes_claimed_step",
            "job_id",
            "claimed_step",
            postgresql_where=text("claimed_step IS NOT NULL AND consumed_step IS NULL"),
        ),
        # metadata retention (rollcall_compact_steps) and the invariant checks' bounded reads
        Index(
            "ix_episodes_consumed_step",
            "job_id",
            "consumed_step",
            postgresql_where=text("consumed_step IS NOT NULL"),
        ),
        Index("ix_episodes_task_id_prompt_index", "task_id", "prompt_index"),
        Index(
            "ix_episodes_requeued_from",
            "requeued_from",
            postgresql_where=text("requeued_from IS NOT NULL"),
        ),
    )


class Trajectory(Base):
    """One sample of a group: the replay buffer. Partitioned by ``task_id``."""

    __tablename__ = "trajectories"

    # Identity: (task, episode, sample). No surrogate key and no status index: fewer indexes
    # to maintain on the write path, and status changes can be HOT updates.
    task_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    episode_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    sample_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    status: Mapped[TrajectoryStatus] = mapped_column(
        _enum(TrajectoryStatus, "trajectory_status"),
        nullable=False,
        server_default=TrajectoryStatus.IN_PROGRESS.value,
    )
    # Lease epoch of the episode when this row was last written (fencing audit).
    lease_epoch: Mapped[int] = mapped_column(BigInteger, nullable=False)
    # The payload (tokens, loss mask, behaviour log-probs) is in ``trajectory_segments``.
    num_tokens: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    prompt_tokens: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    num_turns: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    # Token offset where each turn starts, and the policy version that generated each turn.
    turn_offsets: Mapped[list[int]] = mapped_column(
        ARRAY(Integer), nullable=False, server_default=text("'{}'::integer[]")
    )
    turn_versions: Mapped[list[int]] = mapped_column(
        ARRAY(Integer), nullable=False, server_default=text("'{}'::integer[]")
    )
    # Oldest turn version: the staleness filter compares it with policy_version - max_staleness.
    min_policy_version: Mapped[int | None] = mapped_column(Integer)
    env_state: Mapped[dict[str, Any]] = mapped_column(
        JSONB, nullable=False, server_default=text("'{}'::jsonb")
    )
    finished: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    reward: Mapped[float | None] = mapped_column(Double)
    reward_info: Mapped[dict[str, Any]] = mapped_column(
        JSONB, nullable=False, server_default=text("'{}'::jsonb")
    )
    claimed_step: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = _updated()
    ready_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    consumed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Set when retention dropped the payload's segments (the metadata stays).
    payload_dropped_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # An agent sample's record of calls is kept in ``agent_journal`` rows: how many of them
    # (entries 0 .. journal_calls - 1) are the sample's journal. NULL: no journal rows (a plugin
    # loop's sample, or a state that keeps its journal inline in ``env_state``).
    journal_calls: Mapped[int | None] = mapped_column(Integer)

    __table_args__ = (
        ForeignKeyConstraint(["episode_id"], ["episodes.id"], ondelete="RESTRICT"),
        ForeignKeyConstraint(["task_id"], ["tasks.id"], ondelete="RESTRICT"),
        CheckConstraint("sample_index >= 0", name="sample_index_nonneg"),
        CheckConstraint(
            "(status IN ('ready', 'claimed', 'consumed')) <= (reward IS NOT NULL)",
            name="reward_when_ready",
        ),
        # the foreign key's check when metadata retention deletes an episode
        Index("ix_trajectories_episode_id", "episode_id"),
        {"postgresql_partition_by": "LIST (task_id)"},
    )


class TrajectorySegment(Base):
    """Tokens ``[start_token, end_token)`` of one sample, as one checkpoint appended them.

    Append-only: a checkpoint adds the tokens of its new turns as one row and never rewrites
    earlier rows, so the bytes written per trajectory grow linearly with its length. A sample's
    payload is its segments in ``start_token`` order (``repos.trajectories``). No foreign keys:
    the write path checks nothing it does not need, and retired tasks' partitions detach
    freely; the rows go with their trajectory's retention."""

    __tablename__ = "trajectory_segments"

    task_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    episode_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    sample_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    start_token: Mapped[int] = mapped_column(Integer, primary_key=True)
    end_token: Mapped[int] = mapped_column(Integer, nullable=False)
    # Lease epoch of the holder that wrote the segment (fencing audit).
    lease_epoch: Mapped[int] = mapped_column(BigInteger, nullable=False)
    token_ids: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    loss_mask: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    behaviour_logprobs: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)

    __table_args__ = (CheckConstraint("0 <= start_token AND start_token < end_token", name="span"),)


class AgentJournalEntry(Base):
    """One call of an agent sample's record (``workers/episode``): entry ``seq`` of the journal
    that replay answers calls from, stored as the checkpoint after the call appended it.

    Append-only like ``trajectory_segments``: a checkpoint writes only the calls it added, so
    the bytes written per agent episode grow linearly with its calls. The sample's journal is
    entries ``0 .. trajectories.journal_calls - 1`` in ``seq`` order; an entry at or past that
    count is left over from a run that started over (a divergence) and is overwritten by the
    next write of that position, never read. No foreign keys, as for segments."""

    __tablename__ = "agent_journal"

    task_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    episode_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    sample_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Lease epoch of the holder that wrote the entry (fencing audit).
    lease_epoch: Mapped[int] = mapped_column(BigInteger, nullable=False)
    entry: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)

    __table_args__ = (CheckConstraint("seq >= 0", name="seq_nonneg"),)


class TrainStep(Base):
    __tablename__ = "train_steps"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="RESTRICT"), nullable=False)
    step: Mapped[int] = mapped_column(Integer, nullable=False)
    # The policy version this step produced.
    policy_version: Mapped[int] = mapped_column(Integer, nullable=False)
    task_mix: Mapped[dict[str, Any]] = mapped_column(
        JSONB, nullable=False, server_default=text("'{}'::jsonb")
    )
    num_trajectories: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    checkpoint_uri: Mapped[str | None] = mapped_column(Text)
    metrics: Mapped[dict[str, Any]] = mapped_column(
        JSONB, nullable=False, server_default=text("'{}'::jsonb")
    )
    created_at: Mapped[datetime] = _created()

    __table_args__ = (
        UniqueConstraint("job_id", "step"),
        CheckConstraint("step >= 0", name="step_nonneg"),
    )


class Event(Base):
    """Audit record: operator actions, restarts, drills, quarantines."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))
    task_id: Mapped[int | None] = mapped_column(ForeignKey("tasks.id", ondelete="SET NULL"))
    worker_id: Mapped[int | None] = mapped_column(ForeignKey("workers.id", ondelete="SET NULL"))
    kind: Mapped[str] = mapped_column(String(63), nullable=False)
    actor: Mapped[str] = mapped_column(String(255), nullable=False)
    message: Mapped[str] = mapped_column(Text, nullable=False, server_default="")
    payload: Mapped[dict[str, Any]] = mapped_column(
        JSONB, nullable=False, server_default=text("'{}'::jsonb")
    )
    created_at: Mapped[datetime] = _created()

    __table_args__ = (
        Index("ix_events_job_id_created_at", "job_id", "created_at"),
        Index("ix_events_kind_created_at", "kind", "created_at"),
    )


class CompactedSteps(Base):
    """Metadata retention (``rollcall_compact_steps``): per job, what its compacted steps
    (every step through ``through_step``) added up to; their rows are gone."""

    __tablename__ = "compacted_steps"

    job_id: Mapped[int] = mapped_column(
        ForeignKey("jobs.id", ondelete="RESTRICT"), primary_key=True
    )
    through_step: Mapped[int] = mapped_column(Integer, nullable=False, server_default="-1")
    steps: Mapped[int] = _counter()
    step_trajectories: Mapped[int] = _counter()  # their train_steps.num_trajectories
    consumed_trajectories: Mapped[int] = _counter()  # consumed samples deleted
    episodes: Mapped[int] = _counter()
    trajectories: Mapped[int] = _counter()
    updated_at: Mapped[datetime] = _updated()


class CompactedEpisodes(Base):
    """Metadata retention: per task, the deleted episodes by end state (``consumed``,
    ``expired``) and a consumed group's staleness (-1: none)."""

    __tablename__ = "compacted_episodes"

    job_id: Mapped[int] = mapped_column(
        ForeignKey("jobs.id", ondelete="RESTRICT"), nullable=False, index=True
    )
    task_id: Mapped[int] = mapped_column(
        ForeignKey("tasks.id", ondelete="RESTRICT"), primary_key=True
    )
    state: Mapped[str] = mapped_column(String(16), primary_key=True)
    staleness: Mapped[int] = mapped_column(Integer, primary_key=True)
    episodes: Mapped[int] = _counter()
    samples: Mapped[int] = _counter()
