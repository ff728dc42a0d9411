"""An append-only agent journal: each call an agent function makes through ``ctx`` is one
``agent_journal`` row (``workers/episode``), written by the checkpoint after the call, instead of
one entry of a list inside ``trajectories.env_state`` that every checkpoint rewrote whole (the
bytes written per agent episode grew with the square of its calls; now linearly).
``trajectories.journal_calls`` is how many entries are the sample's journal;
``rollcall_write_sample`` takes the entries a checkpoint adds and the position they start at.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# 0005's write, with the journal: ``p_journal`` (a JSON array, or NULL for a sample whose state
# keeps no journal apart) holds the entries from position ``p_journal_start`` on; the entries
# before it must be stored already (``journal_calls`` of the stored row at least that many,
# else nothing is written and the outcome is ``rebase_journal``: write again from 0). Entries
# from ``p_journal_start`` on are inserted or overwritten and ``journal_calls`` set to where
# they end; entries past it (left by a run that started over) are never read. Entries are
# written only when the row is (a committed sample is never overwritten). The current
# definition: orchestrator/db/schema.sql.
WRITE_FN = """
CREATE FUNCTION rollcall_write_sample(
    p_episode bigint, p_epoch bigint, p_sample integer, p_commit boolean, p_start integer,
    p_token_ids bytea, p_loss_mask bytea, p_logprobs bytea, p_num_tokens integer,
    p_prompt_tokens integer, p_num_turns integer, p_turn_offsets integer[],
    p_turn_versions integer[], p_min_version integer, p_env_state jsonb, p_finished boolean,
    p_reward double precision, p_reward_info jsonb, p_journal_start integer, p_journal jsonb
) RETURNS TABLE (outcome text, group_done boolean) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    ep record;
    n integer;
    v_end integer;
    v_calls integer;
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
    IF p_journal IS NOT NULL AND p_journal_start > 0 THEN
        SELECT tr.journal_calls INTO v_calls FROM trajectories tr
        WHERE tr.task_id = ep.task_id AND tr.episode_id = p_episode
          AND tr.sample_index = p_sample;
        IF v_calls IS NULL OR v_calls < p_journal_start THEN
            RETURN QUERY SELECT 'rebase_journal'::text, false;
            RETURN;
        END IF;
    END IF;
    INSERT INTO trajectories AS tr (
        task_id, episode_id, sample_index, lease_epoch, num_tokens, prompt_tokens, num_turns,
        turn_offsets, turn_versions, min_policy_version, env_state, journal_calls, finished,
        status, reward, reward_info, ready_at
    ) VALUES (
        ep.task_id, p_episode, p_sample, p_epoch, p_num_tokens, p_prompt_tokens, p_num_turns,
        p_turn_offsets, p_turn_versions, p_min_version, p_env_state,
        p_journal_start + jsonb_array_length(p_journal), p_finished,
        CASE WHEN p_commit THEN 'ready' ELSE 'in_progress' END::trajectory_status,
        p_reward, p_reward_info, CASE WHEN p_commit THEN now() END
    )
    ON CONFLICT (task_id, episode_id, sample_index) DO UPDATE SET
        lease_epoch = excluded.lease_epoch, num_tokens = excluded.num_tokens,
        prompt_tokens = excluded.prompt_tokens, num_turns = excluded.num_turns,
        turn_offsets = excluded.turn_offsets, turn_versions = excluded.turn_versions,
        min_policy_version = excluded.min_policy_version, env_state = excluded.env_state,
        journal_calls = excluded.journal_calls, finished = excluded.finished,
        status = excluded.status, reward = excluded.reward, reward_info = excluded.reward_info,
        ready_at = excluded.ready_at, updated_at = now()
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
        IF jsonb_array_length(p_journal) > 0 THEN
            INSERT INTO agent_journal AS j (
                task_id, episode_id, sample_index, seq, lease_epoch, entry
            )
            SELECT ep.task_id, p_episode, p_sample, p_journal_start + c.i::integer - 1, p_epoch,
                   c.entry
            FROM jsonb_array_elements(p_journal) WITH ORDINALITY AS c(entry, i)
            ON CONFLICT (task_id, episode_id, sample_index, seq) DO UPDATE SET
                lease_epoch = excluded.lease_epoch, entry = excluded.entry;
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

OLD_SIGNATURE = (
    "rollcall_write_sample(bigint, bigint, integer, boolean, integer, bytea, bytea, bytea, "
    "integer, integer, integer, integer[], integer[], integer, jsonb, boolean, "
    "double precision, jsonb)"
)
NEW_SIGNATURE = (
    "rollcall_write_sample(bigint, bigint, integer, boolean, integer, bytea, bytea, bytea, "
    "integer, integer, integer, integer[], integer[], integer, jsonb, boolean, "
    "double precision, jsonb, integer, jsonb)"
)

# Journals go back into env_state (state.journal) on a downgrade; detached partitions' too.
_DETACHED = """
SELECT c.relname FROM pg_class c
WHERE c.relname ~ '^trajectories_t[0-9]+$' AND c.relkind = 'r'
  AND NOT EXISTS (SELECT 1 FROM pg_inherits i WHERE i.inhrelid = c.oid)
"""


def _migration(filename: str) -> ModuleType:
    """An earlier migration's module, loaded by its file (its name is no module name): the
    downgrade writes 0005's ``rollcall_write_sample`` again (migrations are history: that file
    does not change)."""
    path = Path(__file__).with_name(filename)
    spec = importlib.util.spec_from_file_location(f"rollcall_migration_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _detached() -> list[str]:
    return [r[0] for r in op.get_bind().execute(sa.text(_DETACHED))]


# Retention deletes a consumed sample's journal rows with its segments: the roles that may
# insert into the table (ops/deploy/postgres-roles.sql's runtime role, by default privileges)
# may delete from it too, as from trajectory_segments (0005).
GRANT_DELETE = """
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT DISTINCT grantee FROM information_schema.role_table_grants
        WHERE table_schema = current_schema() AND table_name = 'agent_journal'
          AND privilege_type = 'INSERT' AND grantee <> current_user
    LOOP
        EXECUTE format('GRANT DELETE ON agent_journal TO %I', r.grantee);
    END LOOP;
END $$
"""


def upgrade() -> None:
    op.create_table(
        "agent_journal",
        sa.Column("task_id", sa.BigInteger(), nullable=False),
        sa.Column("episode_id", sa.BigInteger(), nullable=False),
        sa.Column("sample_index", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("lease_epoch", sa.BigInteger(), nullable=False),
        sa.Column("entry", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.CheckConstraint("seq >= 0", name=op.f("ck_agent_journal_seq_nonneg")),
        sa.PrimaryKeyConstraint(
            "task_id", "episode_id", "sample_index", "seq", name="pk_agent_journal"
        ),
    )
    for table in ["trajectories", *_detached()]:
        op.execute(f"ALTER TABLE {table} ADD COLUMN journal_calls integer")
    op.execute(f"DROP FUNCTION {OLD_SIGNATURE}")
    op.execute(WRITE_FN)
    op.execute(GRANT_DELETE)
    # Journals checkpointed before stay inline in env_state (a state without the writer's
    # journal_stored mark is stored as it is): their samples resume exactly as before.


def downgrade() -> None:
    for table in ["trajectories", *_detached()]:
        op.execute(
            f"""
            UPDATE {table} tr SET env_state = jsonb_set(
                tr.env_state, '{{state}}',
                coalesce(tr.env_state->'state', '{{}}'::jsonb) || jsonb_build_object(
                    'journal', coalesce((
                        SELECT jsonb_agg(j.entry ORDER BY j.seq) FROM agent_journal j
                        WHERE j.task_id = tr.task_id AND j.episode_id = tr.episode_id
                          AND j.sample_index = tr.sample_index AND j.seq < tr.journal_calls
                    ), '[]'::jsonb)))
            WHERE tr.journal_calls IS NOT NULL
            """
        )
        op.execute(f"ALTER TABLE {table} DROP COLUMN journal_calls")
    op.execute(f"DROP FUNCTION {NEW_SIGNATURE}")
    op.execute(_migration("0005_append_only_turns.py").WRITE_FN)
    op.drop_table("agent_journal")
