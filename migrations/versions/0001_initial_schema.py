"""Initial schema: jobs, tasks, workers, episodes, partitioned trajectories, train_steps, events.

Also creates the functions that attach and detach a task's trajectory partition (SECURITY
DEFINER, so the runtime role needs no CREATE privilege) and the job named ``default``.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


ENUMS = (
    "trajectory_status",
    "episode_status",
    "worker_status",
    "worker_role",
    "task_status",
    "job_status",
)

ATTACH_FN = """
CREATE FUNCTION rollcall_attach_task_partition(p_task_id bigint) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    part text := 'trajectories_t' || p_task_id;
BEGIN
    IF to_regclass(part) IS NULL THEN
        EXECUTE format('CREATE TABLE %I PARTITION OF trajectories FOR VALUES IN (%s)', part, p_task_id);
    ELSIF NOT EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = to_regclass(part)) THEN
        EXECUTE format('ALTER TABLE trajectories ATTACH PARTITION %I FOR VALUES IN (%s)', part, p_task_id);
    END IF;
    RETURN part;
END $$
"""

DETACH_FN = """
CREATE FUNCTION rollcall_detach_task_partition(p_task_id bigint) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    part text := 'trajectories_t' || p_task_id;
BEGIN
    IF EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = to_regclass(part)) THEN
        EXECUTE format('ALTER TABLE trajectories DETACH PARTITION %I', part);
    END IF;
    RETURN part;
END $$
"""


def upgrade() -> None:
    op.execute(sa.schema.CreateSequence(sa.Sequence("trajectories_id_seq")))
    op.create_table(
        "jobs",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column(
            "status",
            sa.Enum("created", "running", "stopped", "completed", "failed", name="job_status"),
            server_default="created",
            nullable=False,
        ),
        sa.Column(
            "config",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("policy_version", sa.Integer(), server_default="0", nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint("policy_version >= 0", name=op.f("ck_jobs_policy_version_nonneg")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
        sa.UniqueConstraint("name", name=op.f("uq_jobs_name")),
    )
    op.create_table(
        "tasks",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("plugin", sa.String(length=200), nullable=False),
        sa.Column(
            "spec",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("weight", sa.Double(), nullable=False),
        sa.Column("max_inflight", sa.Integer(), nullable=False),
        sa.Column("max_staleness", sa.Integer(), nullable=False),
        sa.Column(
            "status",
            sa.Enum("active", "paused", "draining", "retired", name="task_status"),
            server_default="active",
            nullable=False,
        ),
        sa.Column("prompt_cursor", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("retired_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("max_inflight >= 1", name=op.f("ck_tasks_max_inflight_min")),
        sa.CheckConstraint("max_staleness >= 0", name=op.f("ck_tasks_max_staleness_nonneg")),
        sa.CheckConstraint("prompt_cursor >= 0", name=op.f("ck_tasks_prompt_cursor_nonneg")),
        sa.CheckConstraint("weight > 0", name=op.f("ck_tasks_weight_positive")),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_tasks_job_id_jobs"), ondelete="RESTRICT"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tasks")),
    )
    op.create_index(
        "uq_tasks_job_id_name_live",
        "tasks",
        ["job_id", "name"],
        unique=True,
        postgresql_where=sa.text("status <> 'retired'"),
    )
    op.create_table(
        "train_steps",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.BigInteger(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column(
            "task_mix",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("num_trajectories", sa.Integer(), server_default="0", nullable=False),
        sa.Column("checkpoint_uri", sa.Text(), nullable=True),
        sa.Column(
            "metrics",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint("step >= 0", name=op.f("ck_train_steps_step_nonneg")),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_train_steps_job_id_jobs"), ondelete="RESTRICT"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_train_steps")),
        sa.UniqueConstraint("job_id", "step", name=op.f("uq_train_steps_job_id_step")),
    )
    op.create_table(
        "workers",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.BigInteger(), nullable=False),
        sa.Column("role", sa.Enum("rollout", "trainer", name="worker_role"), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("incarnation", sa.Integer(), server_default="0", nullable=False),
        sa.Column(
            "status",
            sa.Enum("starting", "alive", "dead", "failed", "stopped", name="worker_status"),
            server_default="starting",
            nullable=False,
        ),
        sa.Column("host", sa.String(length=255), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("node_id", sa.String(length=128), nullable=True),
        sa.Column(
            "started_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "last_heartbeat_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "last_progress_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("tokens_generated", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("restarts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("loaded_version", sa.Integer(), nullable=True),
        sa.Column("stopped_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "info",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_workers_job_id_jobs"), ondelete="RESTRICT"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
        sa.UniqueConstraint(
            "job_id", "name", "incarnation", name=op.f("uq_workers_job_id_name_incarnation")
        ),
    )
    op.create_index("ix_workers_job_id_status", "workers", ["job_id", "status"], unique=False)
    op.create_table(
        "episodes",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.BigInteger(), nullable=False),
        sa.Column("task_id", sa.BigInteger(), nullable=False),
        sa.Column("prompt_index", sa.BigInteger(), nullable=False),
        sa.Column("prompt", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("group_size", sa.Integer(), nullable=False),
        sa.Column(
            "status",
            sa.Enum("queued", "leased", "done", "expired", "quarantined", name="episode_status"),
            server_default="queued",
            nullable=False,
        ),
        sa.Column("lease_owner", sa.BigInteger(), nullable=True),
        sa.Column("lease_epoch", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("leased_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("requeued_from", sa.BigInteger(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "(status = 'leased') = (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)",
            name=op.f("ck_episodes_lease_iff_leased"),
        ),
        sa.CheckConstraint("attempts >= 0", name=op.f("ck_episodes_attempts_nonneg")),
        sa.CheckConstraint("group_size >= 1", name=op.f("ck_episodes_group_size_min")),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_episodes_job_id_jobs"), ondelete="RESTRICT"
        ),
        sa.ForeignKeyConstraint(
            ["lease_owner"],
            ["workers.id"],
            name=op.f("fk_episodes_lease_owner_workers"),
            ondelete="RESTRICT",
        ),
        sa.ForeignKeyConstraint(
            ["requeued_from"],
            ["episodes.id"],
            name=op.f("fk_episodes_requeued_from_episodes"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["task_id"], ["tasks.id"], name=op.f("fk_episodes_task_id_tasks"), ondelete="RESTRICT"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_episodes")),
    )
    op.create_index("ix_episodes_job_id_status", "episodes", ["job_id", "status"], unique=False)
    op.create_index(
        "ix_episodes_lease_expires_at",
        "episodes",
        ["lease_expires_at"],
        unique=False,
        postgresql_where=sa.text("status = 'leased'"),
    )
    op.create_index("ix_episodes_task_id_status", "episodes", ["task_id", "status"], unique=False)
    op.create_table(
        "events",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.BigInteger(), nullable=True),
        sa.Column("task_id", sa.BigInteger(), nullable=True),
        sa.Column("worker_id", sa.BigInteger(), nullable=True),
        sa.Column("kind", sa.String(length=63), nullable=False),
        sa.Column("actor", sa.String(length=255), nullable=False),
        sa.Column("message", sa.Text(), server_default="", nullable=False),
        sa.Column(
            "payload",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_events_job_id_jobs"), ondelete="SET NULL"
        ),
        sa.ForeignKeyConstraint(
            ["task_id"], ["tasks.id"], name=op.f("fk_events_task_id_tasks"), ondelete="SET NULL"
        ),
        sa.ForeignKeyConstraint(
            ["worker_id"],
            ["workers.id"],
            name=op.f("fk_events_worker_id_workers"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    op.create_index("ix_events_job_id_created_at", "events", ["job_id", "created_at"], unique=False)
    op.create_index("ix_events_kind_created_at", "events", ["kind", "created_at"], unique=False)
    op.create_table(
        "trajectories",
        sa.Column("task_id", sa.BigInteger(), nullable=False),
        sa.Column(
            "id",
            sa.BigInteger(),
            server_default=sa.text("nextval('trajectories_id_seq')"),
            nullable=False,
        ),
        sa.Column("episode_id", sa.BigInteger(), nullable=False),
        sa.Column("sample_index", sa.Integer(), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "in_progress", "ready", "claimed", "consumed", "expired", name="trajectory_status"
            ),
            server_default="in_progress",
            nullable=False,
        ),
        sa.Column("lease_epoch", sa.BigInteger(), nullable=False),
        sa.Column(
            "token_ids", sa.LargeBinary(), server_default=sa.text("'\\x'::bytea"), nullable=False
        ),
        sa.Column(
            "loss_mask", sa.LargeBinary(), server_default=sa.text("'\\x'::bytea"), nullable=False
        ),
        sa.Column(
            "behaviour_logprobs",
            sa.LargeBinary(),
            server_default=sa.text("'\\x'::bytea"),
            nullable=False,
        ),
        sa.Column("num_tokens", sa.Integer(), server_default="0", nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), server_default="0", nullable=False),
        sa.Column("num_turns", sa.Integer(), server_default="0", nullable=False),
        sa.Column(
            "turn_offsets",
            postgresql.ARRAY(sa.Integer()),
            server_default=sa.text("'{}'::integer[]"),
            nullable=False,
        ),
        sa.Column(
            "turn_versions",
            postgresql.ARRAY(sa.Integer()),
            server_default=sa.text("'{}'::integer[]"),
            nullable=False,
        ),
        sa.Column("min_policy_version", sa.Integer(), nullable=True),
        sa.Column(
            "env_state",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("finished", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("reward", sa.Double(), nullable=True),
        sa.Column(
            "reward_info",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("claimed_step", sa.Integer(), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("ready_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("consumed_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "(status IN ('ready', 'claimed', 'consumed')) <= (reward IS NOT NULL)",
            name=op.f("ck_trajectories_reward_when_ready"),
        ),
        sa.CheckConstraint("sample_index >= 0", name=op.f("ck_trajectories_sample_index_nonneg")),
        sa.ForeignKeyConstraint(
            ["episode_id"],
            ["episodes.id"],
            name=op.f("fk_trajectories_episode_id_episodes"),
            ondelete="RESTRICT",
        ),
        sa.ForeignKeyConstraint(
            ["task_id"],
            ["tasks.id"],
            name=op.f("fk_trajectories_task_id_tasks"),
            ondelete="RESTRICT",
        ),
        sa.PrimaryKeyConstraint("task_id", "id", name=op.f("pk_trajectories")),
        sa.UniqueConstraint(
            "task_id",
            "episode_id",
            "sample_index",
            name=op.f("uq_trajectories_task_id_episode_id_sample_index"),
        ),
        postgresql_partition_by="LIST (task_id)",
    )
    op.create_index(
        "ix_trajectories_task_id_status",
        "trajectories",
        ["task_id", "status", "min_policy_version"],
        unique=False,
    )
    op.execute(ATTACH_FN)
    op.execute(DETACH_FN)
    op.execute("INSERT INTO jobs (name) VALUES ('default')")


def downgrade() -> None:
    op.execute("DROP FUNCTION IF EXISTS rollcall_attach_task_partition(bigint)")
    op.execute("DROP FUNCTION IF EXISTS rollcall_detach_task_partition(bigint)")
    # Detached partitions of retired tasks are tables of their own; they go with the schema.
    op.execute(
        """
        DO $$
        DECLARE r record;
        BEGIN
            FOR r IN SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                     WHERE n.nspname = current_schema() AND c.relkind = 'r'
                       AND c.relname ~ '^trajectories_t[0-9]+$'
            LOOP
                EXECUTE format('DROP TABLE %I', r.relname);
            END LOOP;
        END $$
        """
    )
    op.drop_index("ix_trajectories_task_id_status", table_name="trajectories")
    op.drop_table("trajectories")
    op.drop_index("ix_events_kind_created_at", table_name="events")
    op.drop_index("ix_events_job_id_created_at", table_name="events")
    op.drop_table("events")
    op.drop_index("ix_episodes_task_id_status", table_name="episodes")
    op.drop_index(
        "ix_episodes_lease_expires_at",
        table_name="episodes",
        postgresql_where=sa.text("status = 'leased'"),
    )
    op.drop_index("ix_episodes_job_id_status", table_name="episodes")
    op.drop_table("episodes")
    op.drop_index("ix_workers_job_id_status", table_name="workers")
    op.drop_table("workers")
    op.drop_table("train_steps")
    op.drop_index(
        "uq_tasks_job_id_name_live",
        table_name="tasks",
        postgresql_where=sa.text("status <> 'retired'"),
    )
    op.drop_table("tasks")
    op.drop_table("jobs")
    op.execute(sa.schema.DropSequence(sa.Sequence("trajectories_id_seq")))
    for name in ENUMS:
        op.execute(f"DROP TYPE {name}")
