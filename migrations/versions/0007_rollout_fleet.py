"""The rollout fleet: the number of rollout nodes an operator set for a running job
(``jobs.rollout_nodes``, ``rollcall job scale``) and each rollout slot's state as the
supervisor sees it (``rollout_slots``: starting, alive, restarting, awaiting_ray,
waiting_capacity, draining, failed, removed), its counted restarts and its machine losses.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STATES = (
    "'starting', 'alive', 'restarting', 'awaiting_ray', 'waiting_capacity', 'draining', "
    "'failed', 'removed'"
)


def upgrade() -> None:
    op.add_column("jobs", sa.Column("rollout_nodes", sa.Integer(), nullable=True))
    op.create_check_constraint(
        op.f("ck_jobs_rollout_nodes_min"), "jobs", "rollout_nodes IS NULL OR rollout_nodes >= 1"
    )
    op.create_table(
        "rollout_slots",
        sa.Column("job_id", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column(
            "state_since", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("ray_node_id", sa.String(length=128), nullable=True),
        sa.Column("restarts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("max_restarts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("machine_losses", sa.Integer(), server_default="0", nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.CheckConstraint(f"state IN ({STATES})", name=op.f("ck_rollout_slots_state")),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_rollout_slots_job_id_jobs"), ondelete="RESTRICT"
        ),
        sa.PrimaryKeyConstraint("job_id", "name", name=op.f("pk_rollout_slots")),
    )


def downgrade() -> None:
    op.drop_table("rollout_slots")
    op.drop_constraint(op.f("ck_jobs_rollout_nodes_min"), "jobs", type_="check")
    op.drop_column("jobs", "rollout_nodes")
