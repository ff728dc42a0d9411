"""The audit log is pruned only by its retention rule: ``rollcall_drop_old_events`` (SECURITY
DEFINER) deletes a job's events older than an age or beyond a count, never the last hour's
nor the job's newest of each kind, and the roles that 0009 let delete from ``events``
(ops/deploy/postgres-roles.sql's runtime role) lose ``DELETE`` on it: a runtime credential can
no longer erase the audit log at will, only age it out as the driver's retention pass does.

Revision ID: 0010
Revises: 0009
Create Date: 2027-01-11
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DROP_OLD_EVENTS = """
CREATE FUNCTION rollcall_drop_old_events(
    p_job bigint, p_age_s double precision, p_count bigint, p_batch integer
) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    n bigint;
BEGIN
    WITH newest_of_kind AS (
        SELECT max(id) AS id FROM events WHERE job_id = p_job GROUP BY kind
    ), beyond_count AS (
        SELECT id FROM events WHERE job_id = p_job AND p_count IS NOT NULL
        ORDER BY id DESC OFFSET p_count LIMIT 1
    ), doomed AS (
        SELECT id FROM events
        WHERE job_id = p_job
          AND created_at < now() - interval '1 hour'
          AND (created_at < now() - make_interval(secs => p_age_s)
               OR id <= (SELECT id FROM beyond_count))
          AND id NOT IN (SELECT id FROM newest_of_kind)
        ORDER BY id LIMIT p_batch
    )
    DELETE FROM events WHERE id IN (SELECT id FROM doomed);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$
"""


def _delete_grants(action: str, privilege: str) -> str:
    """GRANT DELETE on ``events`` to (or REVOKE it from) every role but the owner holding
    ``privilege`` on it."""
    direction = "TO" if action == "GRANT" else "FROM"
    return f"""
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT DISTINCT grantee FROM information_schema.role_table_grants
        WHERE table_schema = current_schema() AND table_name = 'events'
          AND privilege_type = '{privilege}' AND grantee <> current_user
    LOOP
        EXECUTE format('{action} DELETE ON events {direction} %I', r.grantee);
    END LOOP;
END $$
"""


def upgrade() -> None:
    op.execute(DROP_OLD_EVENTS)
    op.execute(_delete_grants("REVOKE", "DELETE"))


def downgrade() -> None:
    op.execute("DROP FUNCTION rollcall_drop_old_events(bigint, double precision, bigint, integer)")
    op.execute(_delete_grants("GRANT", "INSERT"))
