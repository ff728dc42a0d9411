"""User code that fails on an episode's input: the episode is retried with backoff, away from
the node it failed on where there is another (``episodes.retry_at``, ``failed_worker``,
``failed_worker_retry_at``, honoured by ``rollcall_claim``); why a task was paused by the
user-code guard (``tasks.status_reason``) and why a worker was declared dead
(``workers.status_reason``).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# 0002's claim, with one change: a queued episode is not claimed before its ``retry_at``, nor by
# the worker its last run failed on before ``failed_worker_retry_at`` (later than ``retry_at``:
# another node gets the first chance). Unchanged: the task lock, the in-flight cap, SKIP LOCKED,
# the oldest claimable episode first.
CLAIM_FN = """
CREATE OR REPLACE FUNCTION rollcall_claim(
    p_tasks bigint[], p_worker bigint, p_lease_s double precision, p_tau double precision,
    p_wait boolean
) RETURNS TABLE (
    outcome text, skipped bigint[], episode_id bigint, task_id bigint, prompt_index bigint,
    prompt jsonb, group_size integer, lease_epoch bigint, attempts integer, task_name text,
    plugin text, spec jsonb
) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    t bigint;
    tk record;
    ep record;
    n bigint;
    v_skipped bigint[] := '{}';
BEGIN
    FOREACH t IN ARRAY p_tasks LOOP
        IF p_wait THEN
            SELECT k.id, k.name, k.plugin, k.spec, k.max_inflight INTO tk FROM tasks k
            WHERE k.id = t AND k.status IN ('active', 'draining') FOR NO KEY UPDATE;
        ELSE
            SELECT k.id, k.name, k.plugin, k.spec, k.max_inflight INTO tk FROM tasks k
            WHERE k.id = t AND k.status IN ('active', 'draining') FOR NO KEY UPDATE SKIP LOCKED;
        END IF;
        IF NOT FOUND THEN
            IF NOT p_wait THEN
                v_skipped := v_skipped || t;
            END IF;
            CONTINUE;
        END IF;
        SELECT count(*) INTO n FROM episodes e WHERE e.task_id = t AND e.status = 'leased';
        IF n >= tk.max_inflight THEN
            CONTINUE;
        END IF;
        UPDATE episodes e
        SET status = 'leased', lease_owner = p_worker, lease_epoch = e.lease_epoch + 1,
            lease_expires_at = now() + make_interval(secs => p_lease_s),
            leased_at = now(), attempts = e.attempts + 1, updated_at = now()
        WHERE e.id = (
            SELECT q.id FROM episodes q WHERE q.task_id = t AND q.status = 'queued'
              AND (q.retry_at IS NULL OR q.retry_at <= now())
              AND (q.failed_worker IS DISTINCT FROM p_worker
                   OR q.failed_worker_retry_at <= now())
            ORDER BY q.id LIMIT 1 FOR UPDATE SKIP LOCKED
        )
        RETURNING e.id, e.task_id, e.prompt_index, e.prompt, e.group_size, e.lease_epoch,
                  e.attempts INTO ep;
        IF NOT FOUND THEN
            CONTINUE;
        END IF;
        UPDATE tasks SET
            claim_score = claim_score
                * exp(-greatest(extract(epoch FROM now() - claim_score_at), 0) / p_tau) + 1,
            claim_score_at = now()
        WHERE id = t;
        RETURN QUERY SELECT 'leased'::text, v_skipped, ep.id, ep.task_id, ep.prompt_index,
            ep.prompt, ep.group_size, ep.lease_epoch, ep.attempts, tk.name::text,
            tk.plugin::text, tk.spec;
        RETURN;
    END LOOP;
    RETURN QUERY SELECT 'none'::text, v_skipped, NULL::bigint, NULL::bigint, NULL::bigint,
        NULL::jsonb, NULL::integer, NULL::bigint, NULL::integer, NULL::text, NULL::text,
        NULL::jsonb;
END $$
"""


# 0002's ``rollcall_claim``, frozen here for the downgrade (migrations are history).
CLAIM_FN_0002 = """
CREATE OR REPLACE FUNCTION rollcall_claim(
    p_tasks bigint[], p_worker bigint, p_lease_s double precision, p_tau double precision,
    p_wait boolean
) RETURNS TABLE (
    outcome text, skipped bigint[], episode_id bigint, task_id bigint, prompt_index bigint,
    prompt jsonb, group_size integer, lease_epoch bigint, attempts integer, task_name text,
    plugin text, spec jsonb
) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    t bigint;
    tk record;
    ep record;
    n bigint;
    v_skipped bigint[] := '{}';
BEGIN
    FOREACH t IN ARRAY p_tasks LOOP
        IF p_wait THEN
            SELECT k.id, k.name, k.plugin, k.spec, k.max_inflight INTO tk FROM tasks k
            WHERE k.id = t AND k.status IN ('active', 'draining') FOR NO KEY UPDATE;
        ELSE
            SELECT k.id, k.name, k.plugin, k.spec, k.max_inflight INTO tk FROM tasks k
            WHERE k.id = t AND k.status IN ('active', 'draining') FOR NO KEY UPDATE SKIP LOCKED;
        END IF;
        IF NOT FOUND THEN
            IF NOT p_wait THEN
                v_skipped := v_skipped || t;
            END IF;
            CONTINUE;
        END IF;
        SELECT count(*) INTO n FROM episodes e WHERE e.task_id = t AND e.status = 'leased';
        IF n >= tk.max_inflight THEN
            CONTINUE;
        END IF;
        UPDATE episodes e
        SET status = 'leased', lease_owner = p_worker, lease_epoch = e.lease_epoch + 1,
            lease_expires_at = now() + make_interval(secs => p_lease_s),
            leased_at = now(), attempts = e.attempts + 1, updated_at = now()
        WHERE e.id = (
            SELECT q.id FROM episodes q WHERE q.task_id = t AND q.status = 'queued'
            ORDER BY q.id LIMIT 1 FOR UPDATE SKIP LOCKED
        )
        RETURNING e.id, e.task_id, e.prompt_index, e.prompt, e.group_size, e.lease_epoch,
                  e.attempts INTO ep;
        IF NOT FOUND THEN
            CONTINUE;
        END IF;
        UPDATE tasks SET
            claim_score = claim_score
                * exp(-greatest(extract(epoch FROM now() - claim_score_at), 0) / p_tau) + 1,
            claim_score_at = now()
        WHERE id = t;
        RETURN QUERY SELECT 'leased'::text, v_skipped, ep.id, ep.task_id, ep.prompt_index,
            ep.prompt, ep.group_size, ep.lease_epoch, ep.attempts, tk.name::text,
            tk.plugin::text, tk.spec;
        RETURN;
    END LOOP;
    RETURN QUERY SELECT 'none'::text, v_skipped, NULL::bigint, NULL::bigint, NULL::bigint,
        NULL::jsonb, NULL::integer, NULL::bigint, NULL::integer, NULL::text, NULL::text,
        NULL::jsonb;
END $$
"""


def upgrade() -> None:
    op.add_column("episodes", sa.Column("retry_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("episodes", sa.Column("failed_worker", sa.BigInteger(), nullable=True))
    op.add_column(
        "episodes", sa.Column("failed_worker_retry_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column("tasks", sa.Column("status_reason", sa.Text(), nullable=True))
    op.add_column("workers", sa.Column("status_reason", sa.Text(), nullable=True))
    op.execute(CLAIM_FN)


def downgrade() -> None:
    op.execute(CLAIM_FN_0002)
    op.drop_column("workers", "status_reason")
    op.drop_column("tasks", "status_reason")
    op.drop_column("episodes", "failed_worker_retry_at")
    op.drop_column("episodes", "failed_worker")
    op.drop_column("episodes", "retry_at")
