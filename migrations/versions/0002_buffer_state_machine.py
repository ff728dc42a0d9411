"""Buffer state machine: group staleness and step reservation on episodes, per-task counters,
and the partial indexes that claims, admission and batch claims use.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("pending_step", sa.Integer(), nullable=True))
    op.add_column(
        "jobs", sa.Column("pending_mix", postgresql.JSONB(astext_type=sa.Text()), nullable=True)
    )
    op.add_column(
        "tasks", sa.Column("claim_score", sa.Double(), server_default="0", nullable=False)
    )
    op.add_column(
        "tasks",
        sa.Column(
            "claim_score_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
    )
    op.add_column("episodes", sa.Column("min_policy_version", sa.Integer(), nullable=True))
    op.add_column("episodes", sa.Column("claimed_step", sa.Integer(), nullable=True))
    op.add_column("episodes", sa.Column("consumed_step", sa.Integer(), nullable=True))
    op.create_index(
        "ix_episodes_claimed_step",
        "episodes",
        ["job_id", "claimed_step"],
        unique=False,
        postgresql_where=sa.text("claimed_step IS NOT NULL AND consumed_step IS NULL"),
    )
    op.create_index(
        "ix_episodes_lease_owner",
        "episodes",
        ["lease_owner"],
        unique=False,
        postgresql_where=sa.text("status = 'leased'"),
    )
    op.create_index(
        "ix_episodes_queued",
        "episodes",
        ["task_id", "id"],
        unique=False,
        postgresql_where=sa.text("status = 'queued'"),
    )
    op.create_index(
        "ix_episodes_ready",
        "episodes",
        ["task_id", "finished_at"],
        unique=False,
        postgresql_where=sa.text("status = 'done' AND consumed_step IS NULL"),
    )
    op.create_index(
        "ix_episodes_task_id_leased_at", "episodes", ["task_id", "leased_at"], unique=False
    )
    op.add_column(
        "tasks", sa.Column("fenced_rejections", sa.BigInteger(), server_default="0", nullable=False)
    )
    op.add_column(
        "tasks", sa.Column("expired_groups", sa.BigInteger(), server_default="0", nullable=False)
    )
    op.add_column(
        "tasks",
        sa.Column("quarantined_episodes", sa.BigInteger(), server_default="0", nullable=False),
    )
    op.add_column(
        "tasks", sa.Column("requeued_leases", sa.BigInteger(), server_default="0", nullable=False)
    )


def downgrade() -> None:
    op.drop_column("tasks", "claim_score_at")
    op.drop_column("tasks", "claim_score")
    op.drop_column("jobs", "pending_mix")
    op.drop_column("jobs", "pending_step")
    op.drop_column("tasks", "requeued_leases")
    op.drop_column("tasks", "quarantined_episodes")
    op.drop_column("tasks", "expired_groups")
    op.drop_column("tasks", "fenced_rejections")
    op.drop_index("ix_episodes_task_id_leased_at", table_name="episodes")
    op.drop_index(
        "ix_episodes_ready",
        table_name="episodes",
        postgresql_where=sa.text("status = 'done' AND consumed_step IS NULL"),
    )
    op.drop_index(
        "ix_episodes_queued", table_name="episodes", postgresql_where=sa.text("status = 'queued'")
    )
    op.drop_index(
        "ix_episodes_lease_owner",
        table_name="episodes",
        postgresql_where=sa.text("status = 'leased'"),
    )
    op.drop_index(
        "ix_episodes_claimed_step",
        table_name="episodes",
        postgresql_where=sa.text("claimed_step IS NOT NULL AND consumed_step IS NULL"),
    )
    op.drop_column("episodes", "consumed_step")
    op.drop_column("episodes", "claimed_step")
    op.drop_column("episodes", "min_policy_version")
