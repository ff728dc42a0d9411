"""Published weights: the latest policy version whose weights rollout nodes can load, and
where they are. Set in the transaction that commits the step producing them.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("weights_version", sa.Integer(), nullable=True))
    op.add_column("jobs", sa.Column("weights_uri", sa.Text(), nullable=True))
    op.create_check_constraint(
        op.f("ck_jobs_weights_version_nonneg"),
        "jobs",
        "weights_version IS NULL OR weights_version >= 0",
    )


def downgrade() -> None:
    op.drop_constraint(op.f("ck_jobs_weights_version_nonneg"), "jobs", type_="check")
    op.drop_column("jobs", "weights_uri")
    op.drop_column("jobs", "weights_version")
