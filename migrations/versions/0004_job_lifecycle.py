"""Job lifecycle and one driver per job: the job statuses a driver moves through (``stopping``
added, ``completed`` renamed ``finished``), and the driver epoch that step commits are fenced
by (bumped by every driver that takes the job), with who the current driver is.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_STATUSES = ("created", "running", "stopped", "completed", "failed")


def upgrade() -> None:
    op.execute("ALTER TYPE job_status RENAME VALUE 'completed' TO 'finished'")
    op.execute("ALTER TYPE job_status ADD VALUE IF NOT EXISTS 'stopping' AFTER 'running'")
    op.add_column(
        "jobs", sa.Column("driver_epoch", sa.BigInteger(), server_default="0", nullable=False)
    )
    op.add_column(
        "jobs", sa.Column("driver", postgresql.JSONB(astext_type=sa.Text()), nullable=True)
    )


def downgrade() -> None:
    op.drop_column("jobs", "driver")
    op.drop_column("jobs", "driver_epoch")
    # An enum value cannot be dropped: rebuild the type without 'stopping'.
    op.execute("UPDATE jobs SET status = 'stopped' WHERE status = 'stopping'")
    op.execute("ALTER TYPE job_status RENAME TO job_status_0004")
    values = ", ".join(f"'{v}'" for v in OLD_STATUSES)
    op.execute(f"CREATE TYPE job_status AS ENUM ({values})")
    op.execute("ALTER TABLE jobs ALTER COLUMN status DROP DEFAULT")
    op.execute(
        "ALTER TABLE jobs ALTER COLUMN status TYPE job_status USING (CASE status::text "
        "WHEN 'finished' THEN 'completed' ELSE status::text END)::job_status"
    )
    op.execute("ALTER TABLE jobs ALTER COLUMN status SET DEFAULT 'created'")
    op.execute("DROP TYPE job_status_0004")
