"""Event retention: the audit log (``events``) of a job is bounded (``control_plane.
event_retention_s`` / ``event_retention_count``, applied by the driver's retention pass,
``EventRepository.drop_old``). The roles that may insert into ``events``
(ops/deploy/postgres-roles.sql's runtime role, by default privileges) may delete from it too, as
from ``trajectory_segments`` (0005) and ``agent_journal`` (0008). No schema change.

Revision ID: 0009
Revises: 0008
Create Date: 2027-01-04
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _grants(action: str) -> str:
    return f"""
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT DISTINCT grantee FROM information_schema.role_table_grants
        WHERE table_schema = current_schema() AND table_name = 'events'
          AND privilege_type = 'INSERT' AND grantee <> current_user
    LOOP
        EXECUTE format('{action} DELETE ON events {"TO" if action == "GRANT" else "FROM"} %I',
                       r.grantee);
    END LOOP;
END $$
"""


def upgrade() -> None:
    op.execute(_grants("GRANT"))


def downgrade() -> None:
    op.execute(_grants("REVOKE"))
