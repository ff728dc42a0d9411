"""Buffer state machine: group staleness and step reservation on episodes, per-task counters
and claim scores, the pending batch of a job, the partial indexes that claims, admission and
batch claims use, and uncompressed (EXTERNAL) storage for token payloads.

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


# Token payloads are incompressible to pglz in practice; trying costs ~1 ms per 4K-token row.
PAYLOAD_COLUMNS = ("token_ids", "loss_mask", "behaviour_logprobs")


# One claim attempt in one statement (run in autocommit): the task lock is held only while the
# function runs. Every statement of a VOLATILE function sees a fresh snapshot, so the count of
# leased episodes taken after the task lock includes every lease committed before it.
# p_wait = false: tasks whose lock is held elsewhere are skipped (returned in ``skipped``) and
# the function never waits, so it may hold several task locks; p_wait = true: one task, waited
# for. Either way no claimer waits while holding a lock another claimer waits for.
CLAIM_FN = """
CREATE FUNCTION rollcall_claim(
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

# One sample's checkpoint (p_commit = false) or commit (p_commit = true) in one statement, fenced
# by the lease epoch: FOR SHARE lets a group's samples checkpoint concurrently while blocking a
# requeue; FOR UPDATE serialises commits of one group, so exactly one of them sees the group
# whole and completes the episode. A committed sample is never overwritten. Outcomes: written,
# already (committed before: an idempotent repeat), stale (the lease moved on: nothing written).
WRITE_FN = """
CREATE FUNCTION rollcall_write_sample(
    p_episode bigint, p_epoch bigint, p_sample integer, p_commit boolean,
    p_token_ids bytea, p_loss_mask bytea, p_logprobs bytea, p_num_tokens integer,
    p_prompt_tokens integer, p_num_turns integer, p_turn_offsets integer[],
    p_turn_versions integer[], p_min_version integer, p_env_state jsonb, p_finished boolean,
    p_reward double precision, p_reward_info jsonb
) RETURNS TABLE (outcome text, group_done boolean) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    ep record;
    n integer;
    v_outcome text;
    v_done boolean := false;
BEGIN
    IF p_commit THEN
        SELECT e.task_id INTO ep FROM episodes e
        WHERE e.id = p_episode AND e.lease_epoch = p_epoch AND e.status = 'leased' FOR UPDATE;
    ELSE
        SELECT e.task_id INTO ep FROM episodes e
        WHERE e.id = p_episode AND e.lease_epoch = p_epoch AND e.status = 'leased' FOR SHARE;
    END IF;
    IF NOT FOUND THEN
        IF p_commit THEN
            SELECT e.task_id INTO ep FROM episodes e
            WHERE e.id = p_episode AND e.lease_epoch = p_epoch AND e.status = 'done';
            IF FOUND AND EXISTS (
                SELECT 1 FROM trajectories tr WHERE tr.task_id = ep.task_id
                AND tr.episode_id = p_episode AND tr.sample_index = p_sample
                AND tr.status IN ('ready', 'claimed', 'consumed')
            ) THEN
                RETURN QUERY SELECT 'already'::text, true;
                RETURN;
            END IF;
        END IF;
        RETURN QUERY SELECT 'stale'::text, false;
        RETURN;
    END IF;
    INSERT INTO trajectories AS tr (
        task_id, episode_id, sample_index, lease_epoch, token_ids, loss_mask,
        behaviour_logprobs, num_tokens, prompt_tokens, num_turns, turn_offsets, turn_versions,
        min_policy_version, env_state, finished, status, reward, reward_info, ready_at
    ) VALUES (
        ep.task_id, p_episode, p_sample, p_epoch, p_token_ids, p_loss_mask, p_logprobs,
        p_num_tokens, p_prompt_tokens, p_num_turns, p_turn_offsets, p_turn_versions,
        p_min_version, p_env_state, p_finished,
        CASE WHEN p_commit THEN 'ready' ELSE 'in_progress' END::trajectory_status,
        p_reward, p_reward_info, CASE WHEN p_commit THEN now() END
    )
    ON CONFLICT (task_id, episode_id, sample_index) DO UPDATE SET
        lease_epoch = excluded.lease_epoch, token_ids = excluded.token_ids,
        loss_mask = excluded.loss_mask, behaviour_logprobs = excluded.behaviour_logprobs,
        num_tokens = excluded.num_tokens, prompt_tokens = excluded.prompt_tokens,
        num_turns = excluded.num_turns, turn_offsets = excluded.turn_offsets,
        turn_versions = excluded.turn_versions, min_policy_version = excluded.min_policy_version,
        env_state = excluded.env_state, finished = excluded.finished, status = excluded.status,
        reward = excluded.reward, reward_info = excluded.reward_info,
        ready_at = excluded.ready_at, updated_at = now()
    WHERE tr.status = 'in_progress';
    GET DIAGNOSTICS n = ROW_COUNT;
    v_outcome := CASE WHEN n > 0 THEN 'written' ELSE 'already' END;
    IF p_commit THEN
        UPDATE episodes e SET status = 'done', lease_owner = NULL, lease_expires_at = NULL,
               finished_at = now(), updated_at = now(), min_policy_version = prog.m
        FROM (
            SELECT count(*) AS c, min(t.min_policy_version) AS m FROM trajectories t
            WHERE t.task_id = ep.task_id AND t.episode_id = p_episode AND t.status = 'ready'
        ) prog
        WHERE e.id = p_episode AND prog.c >= e.group_size;
        v_done := FOUND;
    END IF;
    RETURN QUERY SELECT v_outcome, v_done;
END $$
"""


def upgrade() -> None:
    op.execute(CLAIM_FN)
    op.execute(WRITE_FN)
    # Trajectories are identified by (task, episode, sample): drop the surrogate key, its
    # sequence and the status index (writes maintain fewer indexes; status updates can be HOT).
    op.drop_index("ix_trajectories_task_id_status", table_name="trajectories")
    op.drop_constraint(
        "uq_trajectories_task_id_episode_id_sample_index", "trajectories", type_="unique"
    )
    op.drop_constraint("pk_trajectories", "trajectories", type_="primary")
    op.drop_column("trajectories", "id")
    op.execute(sa.schema.DropSequence(sa.Sequence("trajectories_id_seq")))
    op.create_primary_key(
        "pk_trajectories", "trajectories", ["task_id", "episode_id", "sample_index"]
    )
    for col in PAYLOAD_COLUMNS:
        op.execute(f"ALTER TABLE trajectories ALTER COLUMN {col} SET STORAGE EXTERNAL")
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
    op.execute(
        "DROP FUNCTION rollcall_claim(bigint[], bigint, double precision, double precision, boolean)"
    )
    op.execute(
        "DROP FUNCTION rollcall_write_sample(bigint, bigint, integer, boolean, bytea, bytea, bytea, "
        "integer, integer, integer, integer[], integer[], integer, jsonb, boolean, "
        "double precision, jsonb)"
    )
    for col in PAYLOAD_COLUMNS:
        op.execute(f"ALTER TABLE trajectories ALTER COLUMN {col} SET STORAGE EXTENDED")
    op.drop_constraint("pk_trajectories", "trajectories", type_="primary")
    op.execute(sa.schema.CreateSequence(sa.Sequence("trajectories_id_seq")))
    op.add_column(
        "trajectories",
        sa.Column(
            "id",
            sa.BigInteger(),
            server_default=sa.text("nextval('trajectories_id_seq')"),
            nullable=False,
        ),
    )
    op.create_primary_key("pk_trajectories", "trajectories", ["task_id", "id"])
    op.create_unique_constraint(
        "uq_trajectories_task_id_episode_id_sample_index",
        "trajectories",
        ["task_id", "episode_id", "sample_index"],
    )
    op.create_index(
        "ix_trajectories_task_id_status",
        "trajectories",
        ["task_id", "status", "min_policy_version"],
    )
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
