"""Metadata retention: the row-level detail of steps older than a window is compacted into
per-task totals (``compacted_episodes``) and per-job totals (``compacted_steps``) by
``rollcall_compact_steps`` (SECURITY DEFINER: the runtime role still has no DELETE on
``episodes`` or ``trajectories``), so a job's reads and its storage stop growing with its age;
``train_steps`` (the per-step summaries) and quarantined episodes (for inspection) stay. Indexes the compaction and the bounded checks
need: episodes by consumed step, by prompt, by the episode they requeued; trajectories by
episode (the foreign key's check when an episode row goes).

Revision ID: 0011
Revises: 0010
Create Date: 2027-01-12
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = """
CREATE TABLE compacted_steps (
    job_id bigint NOT NULL,
    through_step integer DEFAULT '-1'::integer NOT NULL,
    steps bigint DEFAULT '0'::bigint NOT NULL,
    step_trajectories bigint DEFAULT '0'::bigint NOT NULL,
    consumed_trajectories bigint DEFAULT '0'::bigint NOT NULL,
    episodes bigint DEFAULT '0'::bigint NOT NULL,
    trajectories bigint DEFAULT '0'::bigint NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT pk_compacted_steps PRIMARY KEY (job_id),
    CONSTRAINT fk_compacted_steps_job_id_jobs FOREIGN KEY (job_id) REFERENCES jobs(id)
        ON DELETE RESTRICT
);
CREATE TABLE compacted_episodes (
    job_id bigint NOT NULL,
    task_id bigint NOT NULL,
    state character varying(16) NOT NULL,
    staleness integer NOT NULL,
    episodes bigint DEFAULT '0'::bigint NOT NULL,
    samples bigint DEFAULT '0'::bigint NOT NULL,
    CONSTRAINT pk_compacted_episodes PRIMARY KEY (task_id, state, staleness),
    CONSTRAINT fk_compacted_episodes_job_id_jobs FOREIGN KEY (job_id) REFERENCES jobs(id)
        ON DELETE RESTRICT,
    CONSTRAINT fk_compacted_episodes_task_id_tasks FOREIGN KEY (task_id) REFERENCES tasks(id)
        ON DELETE RESTRICT
);
CREATE INDEX ix_compacted_episodes_job_id ON compacted_episodes (job_id);
CREATE INDEX ix_episodes_consumed_step ON episodes (job_id, consumed_step)
    WHERE consumed_step IS NOT NULL;
CREATE INDEX ix_episodes_task_id_prompt_index ON episodes (task_id, prompt_index);
CREATE INDEX ix_episodes_requeued_from ON episodes (requeued_from)
    WHERE requeued_from IS NOT NULL;
CREATE INDEX ix_trajectories_episode_id ON trajectories (episode_id);
"""

COMPACT_STEPS = """
CREATE FUNCTION rollcall_compact_steps(
    p_job bigint, p_keep_steps integer, p_min_age_s double precision, p_max_steps integer
) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    v_through integer;
    v_cut integer;
    v_cut_at timestamp with time zone;
    v_ids bigint[];
    v_trajs bigint;
    v_consumed bigint;
    v_step_trajs bigint;
BEGIN
    INSERT INTO compacted_steps (job_id) VALUES (p_job) ON CONFLICT (job_id) DO NOTHING;
    SELECT c.through_step INTO v_through FROM compacted_steps c WHERE c.job_id = p_job
    FOR UPDATE;
    SELECT s.step INTO v_cut FROM train_steps s WHERE s.job_id = p_job
    ORDER BY s.step DESC LIMIT 1;
    IF v_cut IS NULL THEN
        RETURN 0;
    END IF;
    v_cut := least(v_cut - p_keep_steps, v_through + p_max_steps);
    SELECT s.step, s.created_at INTO v_cut, v_cut_at FROM train_steps s
    WHERE s.job_id = p_job AND s.step > v_through AND s.step <= v_cut
      AND s.created_at < now() - make_interval(secs => p_min_age_s)
    ORDER BY s.step DESC LIMIT 1;
    IF v_cut IS NULL THEN
        RETURN 0;
    END IF;
    WITH trained AS (
        SELECT e.id, e.task_id, e.prompt_index FROM episodes e JOIN tasks t ON t.id = e.task_id
        WHERE e.job_id = p_job AND e.consumed_step > v_through AND e.consumed_step <= v_cut
          AND e.status = 'done'
          AND (e.min_policy_version IS NULL
               OR e.consumed_step - e.min_policy_version <= t.max_staleness)
          AND (SELECT count(*) FILTER (WHERE tr.status = 'consumed') = e.group_size
                      AND count(*) = e.group_size
               FROM trajectories tr WHERE tr.task_id = e.task_id AND tr.episode_id = e.id)
          AND NOT EXISTS (
              SELECT 1 FROM episodes s WHERE s.task_id = e.task_id
                AND s.prompt_index = e.prompt_index AND s.id <> e.id
                AND (s.consumed_step IS NOT NULL OR s.status IN ('queued', 'leased', 'done')))
    ), ended AS (
        SELECT e.id FROM episodes e
        WHERE e.job_id = p_job AND e.status = 'expired'
          AND (e.updated_at <= v_cut_at
               OR (e.task_id, e.prompt_index) IN (SELECT task_id, prompt_index FROM trained))
          AND EXISTS (
              SELECT 1 FROM episodes n WHERE n.task_id = e.task_id
                AND n.prompt_index = e.prompt_index AND n.id > e.id)
    )
    SELECT array_agg(id) INTO v_ids FROM (
        SELECT id FROM trained UNION SELECT id FROM ended
    ) d;
    v_ids := coalesce(v_ids, '{}');
    INSERT INTO compacted_episodes AS c (job_id, task_id, state, staleness, episodes, samples)
    SELECT p_job, e.task_id,
           CASE WHEN e.status = 'done' THEN 'consumed' ELSE e.status::text END,
           CASE WHEN e.status = 'done' AND e.min_policy_version IS NOT NULL
                THEN e.consumed_step - e.min_policy_version ELSE -1 END,
           count(*), sum(e.group_size)
    FROM episodes e WHERE e.id = ANY(v_ids) GROUP BY 2, 3, 4
    ON CONFLICT (task_id, state, staleness) DO UPDATE
    SET episodes = c.episodes + excluded.episodes, samples = c.samples + excluded.samples;
    DELETE FROM trajectory_segments s USING episodes e
    WHERE e.id = ANY(v_ids) AND s.task_id = e.task_id AND s.episode_id = e.id;
    DELETE FROM agent_journal j USING episodes e
    WHERE e.id = ANY(v_ids) AND j.task_id = e.task_id AND j.episode_id = e.id;
    WITH gone AS (
        DELETE FROM trajectories tr USING episodes e
        WHERE e.id = ANY(v_ids) AND tr.task_id = e.task_id AND tr.episode_id = e.id
        RETURNING tr.status
    )
    SELECT count(*), count(*) FILTER (WHERE status = 'consumed') INTO v_trajs, v_consumed
    FROM gone;
    DELETE FROM episodes e WHERE e.id = ANY(v_ids);
    SELECT coalesce(sum(s.num_trajectories), 0) INTO v_step_trajs FROM train_steps s
    WHERE s.job_id = p_job AND s.step > v_through AND s.step <= v_cut;
    UPDATE compacted_steps c SET
        steps = c.steps + (SELECT count(*) FROM train_steps s
                           WHERE s.job_id = p_job AND s.step > v_through AND s.step <= v_cut),
        through_step = v_cut, step_trajectories = c.step_trajectories + v_step_trajs,
        consumed_trajectories = c.consumed_trajectories + v_consumed,
        episodes = c.episodes + cardinality(v_ids), trajectories = c.trajectories + v_trajs,
        updated_at = now()
    WHERE c.job_id = p_job;
    RETURN cardinality(v_ids);
END $$
"""


def upgrade() -> None:
    op.execute(TABLES)
    op.execute(COMPACT_STEPS)


def downgrade() -> None:
    op.execute("DROP FUNCTION rollcall_compact_steps(bigint, integer, double precision, integer)")
    op.execute(
        """
        DROP INDEX ix_trajectories_episode_id;
        DROP INDEX ix_episodes_requeued_from;
        DROP INDEX ix_episodes_task_id_prompt_index;
        DROP INDEX ix_episodes_consumed_step;
        DROP TABLE compacted_episodes;
        DROP TABLE compacted_steps;
        """
    )
