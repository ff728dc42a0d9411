"""Append-only trajectory payloads: a sample's tokens, loss mask and behaviour log-probs live
in ``trajectory_segments``, one row per checkpoint that added tokens, so a per-turn
checkpoint writes only the new turn's bytes (and the sample's small metadata row) instead of
rewriting the whole trajectory. ``rollcall_write_sample`` takes the offset its bytes start at;
``trajectories.payload_dropped_at`` marks a payload dropped by retention (the metadata stays).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PAYLOAD_COLUMNS = ("token_ids", "loss_mask", "behaviour_logprobs")

# One sample's checkpoint (p_commit = false) or commit (p_commit = true) in one statement, fenced
# by the lease epoch as in 0002 (FOR SHARE for checkpoints, FOR UPDATE for commits; a committed
# sample is never overwritten). The payload arguments hold tokens [p_start, p_num_tokens) only:
# segments at or past p_start (left by an earlier try of this very write, or by a trajectory
# that started over) are replaced, earlier ones are kept untouched. The writer's idea of what is
# stored is checked first: the segment before p_start must end at p_start, else nothing is
# written and the outcome is ``rebase`` (write again from 0). Outcomes: written, already
# (committed before: an idempotent repeat), stale (the lease moved on), rebase.
WRITE_FN = """
CREATE FUNCTION rollcall_write_sample(
    p_episode bigint, p_epoch bigint, p_sample integer, p_commit boolean, p_start integer,
    p_token_ids bytea, p_loss_mask bytea, p_logprobs bytea, p_num_tokens integer,
    p_prompt_tokens integer, p_num_turns integer, p_turn_offsets integer[],
    p_turn_versions integer[], p_min_version integer, p_env_state jsonb, p_finished boolean,
    p_reward double precision, p_reward_info jsonb
) RETURNS TABLE (outcome text, group_done boolean) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    ep record;
    n integer;
    v_end integer;
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
    IF p_start > 0 THEN
        SELECT s.end_token INTO v_end FROM trajectory_segments s
        WHERE s.task_id = ep.task_id AND s.episode_id = p_episode AND s.sample_index = p_sample
          AND s.start_token < p_start
        ORDER BY s.start_token DESC LIMIT 1;
        IF v_end IS DISTINCT FROM p_start THEN
            RETURN QUERY SELECT 'rebase'::text, false;
            RETURN;
        END IF;
    END IF;
    INSERT INTO trajectories AS tr (
        task_id, episode_id, sample_index, lease_epoch, num_tokens, prompt_tokens, num_turns,
        turn_offsets, turn_versions, min_policy_version, env_state, finished, status, reward,
        reward_info, ready_at
    ) VALUES (
        ep.task_id, p_episode, p_sample, p_epoch, p_num_tokens, p_prompt_tokens, p_num_turns,
        p_turn_offsets, p_turn_versions, p_min_version, p_env_state, p_finished,
        CASE WHEN p_commit THEN 'ready' ELSE 'in_progress' END::trajectory_status,
        p_reward, p_reward_info, CASE WHEN p_commit THEN now() END
    )
    ON CONFLICT (task_id, episode_id, sample_index) DO UPDATE SET
        lease_epoch = excluded.lease_epoch, num_tokens = excluded.num_tokens,
        prompt_tokens = excluded.prompt_tokens, num_turns = excluded.num_turns,
        turn_offsets = excluded.turn_offsets, turn_versions = excluded.turn_versions,
        min_policy_version = excluded.min_policy_version, env_state = excluded.env_state,
        finished = excluded.finished, status = excluded.status, reward = excluded.reward,
        reward_info = excluded.reward_info, ready_at = excluded.ready_at, updated_at = now()
    WHERE tr.status = 'in_progress';
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 THEN
        DELETE FROM trajectory_segments s
        WHERE s.task_id = ep.task_id AND s.episode_id = p_episode AND s.sample_index = p_sample
          AND s.start_token >= p_start;
        IF p_num_tokens > p_start THEN
            INSERT INTO trajectory_segments (
                task_id, episode_id, sample_index, start_token, end_token, lease_epoch,
                token_ids, loss_mask, behaviour_logprobs
            ) VALUES (
                ep.task_id, p_episode, p_sample, p_start, p_num_tokens, p_epoch, p_token_ids,
                p_loss_mask, p_logprobs
            );
        END IF;
    END IF;
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

# 0002's ``rollcall_write_sample``, frozen here for the downgrade (migrations are history).
WRITE_FN_0002 = """
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

OLD_SIGNATURE = (
    "rollcall_write_sample(bigint, bigint, integer, boolean, bytea, bytea, bytea, integer, "
    "integer, integer, integer[], integer[], integer, jsonb, boolean, double precision, jsonb)"
)
NEW_SIGNATURE = (
    "rollcall_write_sample(bigint, bigint, integer, boolean, integer, bytea, bytea, bytea, "
    "integer, integer, integer, integer[], integer[], integer, jsonb, boolean, "
    "double precision, jsonb)"
)

# Segments are the one table rows are deleted from (a checkpoint that replaces segments, and
# retention): the roles that may insert into it (ops/deploy/postgres-roles.sql's runtime role,
# by default privileges) may delete from it too.
GRANT_DELETE = """
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT DISTINCT grantee FROM information_schema.role_table_grants
        WHERE table_schema = current_schema() AND table_name = 'trajectory_segments'
          AND privilege_type = 'INSERT' AND grantee <> current_user
    LOOP
        EXECUTE format('GRANT DELETE ON trajectory_segments TO %I', r.grantee);
    END LOOP;
END $$
"""

# Trajectory partitions detached by a retired task are not reached through the parent table.
_DETACHED = """
SELECT c.relname FROM pg_class c
WHERE c.relname ~ '^trajectories_t[0-9]+$' AND c.relkind = 'r'
  AND NOT EXISTS (SELECT 1 FROM pg_inherits i WHERE i.inhrelid = c.oid)
"""


def _detached() -> list[str]:
    return [r[0] for r in op.get_bind().execute(sa.text(_DETACHED))]


def upgrade() -> None:
    op.create_table(
        "trajectory_segments",
        sa.Column("task_id", sa.BigInteger(), nullable=False),
        sa.Column("episode_id", sa.BigInteger(), nullable=False),
        sa.Column("sample_index", sa.Integer(), nullable=False),
        sa.Column("start_token", sa.Integer(), nullable=False),
        sa.Column("end_token", sa.Integer(), nullable=False),
        sa.Column("lease_epoch", sa.BigInteger(), nullable=False),
        sa.Column("token_ids", sa.LargeBinary(), nullable=False),
        sa.Column("loss_mask", sa.LargeBinary(), nullable=False),
        sa.Column("behaviour_logprobs", sa.LargeBinary(), nullable=False),
        sa.CheckConstraint(
            "0 <= start_token AND start_token < end_token", name="ck_trajectory_segments_span"
        ),
        sa.PrimaryKeyConstraint(
            "task_id",
            "episode_id",
            "sample_index",
            "start_token",
            name="pk_trajectory_segments",
        ),
    )
    for col in PAYLOAD_COLUMNS:
        op.execute(f"ALTER TABLE trajectory_segments ALTER COLUMN {col} SET STORAGE EXTERNAL")
    op.execute(GRANT_DELETE)
    # Every stored payload becomes one segment; detached partitions' too.
    for table in ["trajectories", *_detached()]:
        op.execute(
            f"""
            INSERT INTO trajectory_segments (task_id, episode_id, sample_index, start_token,
                end_token, lease_epoch, token_ids, loss_mask, behaviour_logprobs)
            SELECT task_id, episode_id, sample_index, 0, length(loss_mask), lease_epoch,
                   token_ids, loss_mask, behaviour_logprobs
            FROM {table} WHERE length(loss_mask) > 0
            """
        )
    op.execute(f"DROP FUNCTION {OLD_SIGNATURE}")
    op.execute(WRITE_FN)
    for table in ["trajectories", *_detached()]:
        for col in PAYLOAD_COLUMNS:
            op.execute(f"ALTER TABLE {table} DROP COLUMN {col}")
        op.execute(f"ALTER TABLE {table} ADD COLUMN payload_dropped_at timestamp with time zone")


def downgrade() -> None:
    for table in ["trajectories", *_detached()]:
        op.execute(f"ALTER TABLE {table} DROP COLUMN payload_dropped_at")
        for col in PAYLOAD_COLUMNS:
            op.execute(f"ALTER TABLE {table} ADD COLUMN {col} bytea DEFAULT '\\x'::bytea NOT NULL")
    for table in ["trajectories", *_detached()]:
        if table == "trajectories":
            for col in PAYLOAD_COLUMNS:
                op.execute(f"ALTER TABLE trajectories ALTER COLUMN {col} SET STORAGE EXTERNAL")
        op.execute(
            f"""
            UPDATE {table} tr SET token_ids = s.t, loss_mask = s.m, behaviour_logprobs = s.l
            FROM (
                SELECT task_id, episode_id, sample_index,
                       string_agg(token_ids, ''::bytea ORDER BY start_token) AS t,
                       string_agg(loss_mask, ''::bytea ORDER BY start_token) AS m,
                       string_agg(behaviour_logprobs, ''::bytea ORDER BY start_token) AS l
                FROM trajectory_segments GROUP BY 1, 2, 3
            ) s
            WHERE s.task_id = tr.task_id AND s.episode_id = tr.episode_id
              AND s.sample_index = tr.sample_index
            """
        )
    op.execute(f"DROP FUNCTION {NEW_SIGNATURE}")
    op.execute(WRITE_FN_0002)
    op.drop_table("trajectory_segments")
