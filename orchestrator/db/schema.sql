-- rollcall's schema as it is at the head migration, in one place: the tables, indexes, types
-- and every SQL function, in their current definitions.
--
-- The migrations (migrations/versions/) are deltas from one revision to the next and stay the
-- way a database is changed (`rollcall db upgrade`); this file is what they add up to, to
-- read (applied to an empty database it gives the same schema, without Alembic's version
-- table). tests/integration/test_schema_file.py applies the migrations to one fresh database
-- and this file to another and compares their catalogs (columns, defaults, constraints,
-- indexes, sequences, types, function definitions): a migration that changes the schema
-- changes this file in the same commit.
--
-- Per-task trajectory partitions (trajectories_t<task id>) are created when a task is
-- registered (rollcall_attach_task_partition), not here.

-- -- types ------------------------------------------------------------------------------------

CREATE TYPE job_status AS ENUM ('created', 'running', 'stopping', 'stopped', 'finished', 'failed');
CREATE TYPE task_status AS ENUM ('active', 'paused', 'draining', 'retired');
CREATE TYPE worker_role AS ENUM ('rollout', 'trainer');
CREATE TYPE worker_status AS ENUM ('starting', 'alive', 'dead', 'failed', 'stopped');
CREATE TYPE episode_status AS ENUM ('queued', 'leased', 'done', 'expired', 'quarantined');
CREATE TYPE trajectory_status AS ENUM ('in_progress', 'ready', 'claimed', 'consumed', 'expired');

-- -- tables -----------------------------------------------------------------------------------

-- A training run. The job named 'default' always exists (inserted at the end).
CREATE TABLE jobs (
    id bigserial NOT NULL,
    name character varying(63) NOT NULL,
    status job_status DEFAULT 'created'::job_status NOT NULL,
    config jsonb DEFAULT '{}'::jsonb NOT NULL,
    policy_version integer DEFAULT 0 NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    -- the batch the trainer reserved for the step it has not committed yet
    pending_step integer,
    pending_mix jsonb,
    -- the latest published weights rollout nodes load
    weights_version integer,
    weights_uri text,
    -- the driver that holds the job; step commits are fenced by its epoch
    driver_epoch bigint DEFAULT '0'::bigint NOT NULL,
    driver jsonb,
    -- the fleet size the running job should have (rollcall job scale)
    rollout_nodes integer,
    CONSTRAINT pk_jobs PRIMARY KEY (id),
    CONSTRAINT uq_jobs_name UNIQUE (name),
    CONSTRAINT ck_jobs_policy_version_nonneg CHECK (policy_version >= 0),
    CONSTRAINT ck_jobs_rollout_nodes_min CHECK (rollout_nodes IS NULL OR rollout_nodes >= 1),
    CONSTRAINT ck_jobs_weights_version_nonneg CHECK (weights_version IS NULL OR weights_version >= 0)
);

-- A task of a job: its plugin and validated spec, quotas, status, prompt cursor, counters.
CREATE TABLE tasks (
    id bigserial NOT NULL,
    job_id bigint NOT NULL,
    name character varying(63) NOT NULL,
    plugin character varying(200) NOT NULL,
    spec jsonb DEFAULT '{}'::jsonb NOT NULL,
    weight double precision NOT NULL,
    max_inflight integer NOT NULL,
    max_staleness integer NOT NULL,
    status task_status DEFAULT 'active'::task_status NOT NULL,
    prompt_cursor bigint DEFAULT '0'::bigint NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    retired_at timestamp with time zone,
    -- recent claims, decayed (rollcall_claim): the fair-share deficit
    claim_score double precision DEFAULT '0'::double precision NOT NULL,
    claim_score_at timestamp with time zone DEFAULT now() NOT NULL,
    fenced_rejections bigint DEFAULT '0'::bigint NOT NULL,
    expired_groups bigint DEFAULT '0'::bigint NOT NULL,
    quarantined_episodes bigint DEFAULT '0'::bigint NOT NULL,
    requeued_leases bigint DEFAULT '0'::bigint NOT NULL,
    -- why the user-code guard paused it
    status_reason text,
    CONSTRAINT pk_tasks PRIMARY KEY (id),
    CONSTRAINT fk_tasks_job_id_jobs FOREIGN KEY (job_id) REFERENCES jobs(id) ON DELETE RESTRICT,
    CONSTRAINT ck_tasks_max_inflight_min CHECK (max_inflight >= 1),
    CONSTRAINT ck_tasks_max_staleness_nonneg CHECK (max_staleness >= 0),
    CONSTRAINT ck_tasks_prompt_cursor_nonneg CHECK (prompt_cursor >= 0),
    CONSTRAINT ck_tasks_weight_positive CHECK (weight > 0)
);
CREATE UNIQUE INDEX uq_tasks_job_id_name_live ON tasks (job_id, name) WHERE status <> 'retired';

-- One incarnation of a rollout node or trainer rank.
CREATE TABLE workers (
    id bigserial NOT NULL,
    job_id bigint NOT NULL,
    role worker_role NOT NULL,
    name character varying(63) NOT NULL,
    incarnation integer DEFAULT 0 NOT NULL,
    status worker_status DEFAULT 'starting'::worker_status NOT NULL,
    host character varying(255),
    pid integer,
    node_id character varying(128),
    started_at timestamp with time zone DEFAULT now() NOT NULL,
    last_heartbeat_at timestamp with time zone DEFAULT now() NOT NULL,
    last_progress_at timestamp with time zone DEFAULT now() NOT NULL,
    tokens_generated bigint DEFAULT '0'::bigint NOT NULL,
    restarts integer DEFAULT 0 NOT NULL,
    loaded_version integer,
    stopped_at timestamp with time zone,
    info jsonb DEFAULT '{}'::jsonb NOT NULL,
    -- why it was declared dead
    status_reason text,
    CONSTRAINT pk_workers PRIMARY KEY (id),
    CONSTRAINT uq_workers_job_id_name_incarnation UNIQUE (job_id, name, incarnation),
    CONSTRAINT fk_workers_job_id_jobs FOREIGN KEY (job_id) REFERENCES jobs(id) ON DELETE RESTRICT
);
CREATE INDEX ix_workers_job_id_status ON workers (job_id, status);

-- One rollout node slot of a job as the driver's supervisor sees it.
CREATE TABLE rollout_slots (
    job_id bigint NOT NULL,
    name character varying(63) NOT NULL,
    state character varying(32) NOT NULL,
    state_since timestamp with time zone DEFAULT now() NOT NULL,
    ray_node_id character varying(128),
    restarts integer DEFAULT 0 NOT NULL,
    max_restarts integer DEFAULT 0 NOT NULL,
    machine_losses integer DEFAULT 0 NOT NULL,
    reason text,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT pk_rollout_slots PRIMARY KEY (job_id, name),
    CONSTRAINT fk_rollout_slots_job_id_jobs FOREIGN KEY (job_id) REFERENCES jobs(id)
        ON DELETE RESTRICT,
    CONSTRAINT ck_rollout_slots_state CHECK (state IN ('starting', 'alive', 'restarting',
        'awaiting_ray', 'waiting_capacity', 'draining', 'failed', 'removed'))
);

-- One prompt x group_size samples, the unit of work, with its lease.
CREATE TABLE episodes (
    id bigserial NOT NULL,
    job_id bigint NOT NULL,
    task_id bigint NOT NULL,
    prompt_index bigint NOT NULL,
    prompt jsonb NOT NULL,
    group_size integer NOT NULL,
    status episode_status DEFAULT 'queued'::episode_status NOT NULL,
    lease_owner bigint,
    lease_epoch bigint DEFAULT '0'::bigint NOT NULL,
    lease_expires_at timestamp with time zone,
    leased_at timestamp with time zone,
    attempts integer DEFAULT 0 NOT NULL,
    requeued_from bigint,
    last_error text,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    finished_at timestamp with time zone,
    -- the oldest turn's policy version of the finished group (staleness)
    min_policy_version integer,
    -- the step that reserved the group, and the one that trained on it
    claimed_step integer,
    consumed_step integer,
    -- the backoff after its user code failed
    retry_at timestamp with time zone,
    failed_worker bigint,
    failed_worker_retry_at timestamp with time zone,
    CONSTRAINT pk_episodes PRIMARY KEY (id),
    CONSTRAINT fk_episodes_job_id_jobs FOREIGN KEY (job_id) REFERENCES jobs(id)
        ON DELETE RESTRICT,
    CONSTRAINT fk_episodes_lease_owner_workers FOREIGN KEY (lease_owner) REFERENCES workers(id)
        ON DELETE RESTRICT,
    CONSTRAINT fk_episodes_requeued_from_episodes FOREIGN KEY (requeued_from)
        REFERENCES episodes(id) ON DELETE SET NULL,
    CONSTRAINT fk_episodes_task_id_tasks FOREIGN KEY (task_id) REFERENCES tasks(id)
        ON DELETE RESTRICT,
    CONSTRAINT ck_episodes_attempts_nonneg CHECK (attempts >= 0),
    CONSTRAINT ck_episodes_group_size_min CHECK (group_size >= 1),
    CONSTRAINT ck_episodes_lease_iff_leased
        CHECK ((status = 'leased') = (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL))
);
-- room in each page for the new versions of its rows (a lease renewal at every heartbeat is a
-- HOT update when the page has room; migration 0012)
ALTER TABLE episodes SET (fillfactor = 80);
CREATE INDEX ix_episodes_job_id_status ON episodes (job_id, status);
CREATE INDEX ix_episodes_task_id_status ON episodes (task_id, status);
CREATE INDEX ix_episodes_task_id_leased_at ON episodes (task_id, leased_at);
CREATE INDEX ix_episodes_lease_owner ON episodes (lease_owner) WHERE status = 'leased';
CREATE INDEX ix_episodes_queued ON episodes (task_id, id) WHERE status = 'queued';
CREATE INDEX ix_episodes_ready ON episodes (task_id, finished_at)
    WHERE status = 'done' AND consumed_step IS NULL;
CREATE INDEX ix_episodes_claimed_step ON episodes (job_id, claimed_step)
    WHERE claimed_step IS NOT NULL AND consumed_step IS NULL;
-- metadata retention (rollcall_compact_steps) and the checks' bounded reads
CREATE INDEX ix_episodes_consumed_step ON episodes (job_id, consumed_step)
    WHERE consumed_step IS NOT NULL;
CREATE INDEX ix_episodes_task_id_prompt_index ON episodes (task_id, prompt_index);
CREATE INDEX ix_episodes_requeued_from ON episodes (requeued_from)
    WHERE requeued_from IS NOT NULL;

-- One sample of a group (the replay buffer's metadata), one partition per task. Its tokens are
-- in trajectory_segments; an agent sample's record of calls in agent_journal.
CREATE TABLE trajectories (
    task_id bigint NOT NULL,
    episode_id bigint NOT NULL,
    sample_index integer NOT NULL,
    status trajectory_status DEFAULT 'in_progress'::trajectory_status NOT NULL,
    lease_epoch bigint NOT NULL,
    num_tokens integer DEFAULT 0 NOT NULL,
    prompt_tokens integer DEFAULT 0 NOT NULL,
    num_turns integer DEFAULT 0 NOT NULL,
    turn_offsets integer[] DEFAULT '{}'::integer[] NOT NULL,
    turn_versions integer[] DEFAULT '{}'::integer[] NOT NULL,
    min_policy_version integer,
    env_state jsonb DEFAULT '{}'::jsonb NOT NULL,
    finished boolean DEFAULT false NOT NULL,
    reward double precision,
    reward_info jsonb DEFAULT '{}'::jsonb NOT NULL,
    claimed_step integer,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    ready_at timestamp with time zone,
    consumed_at timestamp with time zone,
    -- retention dropped the payload's segments (the metadata stays)
    payload_dropped_at timestamp with time zone,
    -- an agent sample's journal: agent_journal entries 0 .. journal_calls - 1 (NULL: none)
    journal_calls integer,
    CONSTRAINT pk_trajectories PRIMARY KEY (task_id, episode_id, sample_index),
    CONSTRAINT fk_trajectories_episode_id_episodes FOREIGN KEY (episode_id)
        REFERENCES episodes(id) ON DELETE RESTRICT,
    CONSTRAINT fk_trajectories_task_id_tasks FOREIGN KEY (task_id) REFERENCES tasks(id)
        ON DELETE RESTRICT,
    CONSTRAINT ck_trajectories_reward_when_ready
        CHECK ((status IN ('ready', 'claimed', 'consumed')) <= (reward IS NOT NULL)),
    CONSTRAINT ck_trajectories_sample_index_nonneg CHECK (sample_index >= 0)
) PARTITION BY LIST (task_id);
-- an episode's samples (the foreign key's check when metadata retention deletes an episode)
CREATE INDEX ix_trajectories_episode_id ON trajectories (episode_id);

-- The tokens [start_token, end_token) one checkpoint added to a sample (append-only); a
-- sample's payload is its segments in order. The one table rows are deleted from (a replaced
-- checkpoint, retention).
CREATE TABLE trajectory_segments (
    task_id bigint NOT NULL,
    episode_id bigint NOT NULL,
    sample_index integer NOT NULL,
    start_token integer NOT NULL,
    end_token integer NOT NULL,
    lease_epoch bigint NOT NULL,
    token_ids bytea NOT NULL,
    loss_mask bytea NOT NULL,
    behaviour_logprobs bytea NOT NULL,
    CONSTRAINT pk_trajectory_segments
        PRIMARY KEY (task_id, episode_id, sample_index, start_token),
    CONSTRAINT ck_trajectory_segments_ck_trajectory_segments_span
        CHECK (0 <= start_token AND start_token < end_token)
);
-- token payloads are incompressible in practice: not compressed (about 1 ms per 4K-token row)
ALTER TABLE trajectory_segments ALTER COLUMN token_ids SET STORAGE EXTERNAL;
ALTER TABLE trajectory_segments ALTER COLUMN loss_mask SET STORAGE EXTERNAL;
ALTER TABLE trajectory_segments ALTER COLUMN behaviour_logprobs SET STORAGE EXTERNAL;
-- a row stays in its page up to 8 KB (a turn of up to about 900 tokens): no TOAST rows and
-- TOAST index entries per checkpoint below that (migration 0012)
ALTER TABLE trajectory_segments SET (toast_tuple_target = 8160);

-- One call of an agent sample's record of calls, written by the checkpoint after the call
-- (append-only); the sample's journal is entries 0 .. trajectories.journal_calls - 1 in seq
-- order (an entry past it, left by a run that started over, is never read; the next write of
-- entries at or before it deletes it).
CREATE TABLE agent_journal (
    task_id bigint NOT NULL,
    episode_id bigint NOT NULL,
    sample_index integer NOT NULL,
    seq integer NOT NULL,
    lease_epoch bigint NOT NULL,
    entry jsonb NOT NULL,
    CONSTRAINT pk_agent_journal PRIMARY KEY (task_id, episode_id, sample_index, seq),
    CONSTRAINT ck_agent_journal_seq_nonneg CHECK (seq >= 0)
);

-- One committed optimizer step.
CREATE TABLE train_steps (
    id bigserial NOT NULL,
    job_id bigint NOT NULL,
    step integer NOT NULL,
    policy_version integer NOT NULL,
    task_mix jsonb DEFAULT '{}'::jsonb NOT NULL,
    num_trajectories integer DEFAULT 0 NOT NULL,
    checkpoint_uri text,
    metrics jsonb DEFAULT '{}'::jsonb NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT pk_train_steps PRIMARY KEY (id),
    CONSTRAINT uq_train_steps_job_id_step UNIQUE (job_id, step),
    CONSTRAINT fk_train_steps_job_id_jobs FOREIGN KEY (job_id) REFERENCES jobs(id)
        ON DELETE RESTRICT,
    CONSTRAINT ck_train_steps_step_nonneg CHECK (step >= 0)
);

-- The audit log.
CREATE TABLE events (
    id bigserial NOT NULL,
    job_id bigint,
    task_id bigint,
    worker_id bigint,
    kind character varying(63) NOT NULL,
    actor character varying(255) NOT NULL,
    message text DEFAULT ''::text NOT NULL,
    payload jsonb DEFAULT '{}'::jsonb NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT pk_events PRIMARY KEY (id),
    CONSTRAINT fk_events_job_id_jobs FOREIGN KEY (job_id) REFERENCES jobs(id) ON DELETE SET NULL,
    CONSTRAINT fk_events_task_id_tasks FOREIGN KEY (task_id) REFERENCES tasks(id)
        ON DELETE SET NULL,
    CONSTRAINT fk_events_worker_id_workers FOREIGN KEY (worker_id) REFERENCES workers(id)
        ON DELETE SET NULL
);
CREATE INDEX ix_events_job_id_created_at ON events (job_id, created_at);
CREATE INDEX ix_events_kind_created_at ON events (kind, created_at);

-- Metadata retention (rollcall_compact_steps): what the deleted rows of a job's old steps
-- added up to. Per job: the steps compacted (every step through through_step), their
-- num_trajectories, and the consumed samples, episodes and samples deleted with them.
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
-- Per task: the deleted episodes by end state (consumed, expired) and, for a consumed group,
-- its staleness in versions (-1: none recorded, or not consumed).
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

-- -- functions --------------------------------------------------------------------------------

-- A task's trajectory partition, created (or attached again) at registration and detached at
-- retirement. SECURITY DEFINER: a runtime role needs no CREATE privilege.
CREATE FUNCTION rollcall_attach_task_partition(p_task_id bigint) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    part text := 'trajectories_t' || p_task_id;
BEGIN
    IF to_regclass(part) IS NULL THEN
        EXECUTE format('CREATE TABLE %I PARTITION OF trajectories FOR VALUES IN (%s)', part, p_task_id);
    ELSIF NOT EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = to_regclass(part)) THEN
        EXECUTE format('ALTER TABLE trajectories ATTACH PARTITION %I FOR VALUES IN (%s)', part, p_task_id);
    END IF;
    RETURN part;
END $$;

CREATE FUNCTION rollcall_detach_task_partition(p_task_id bigint) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    part text := 'trajectories_t' || p_task_id;
BEGIN
    IF EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = to_regclass(part)) THEN
        EXECUTE format('ALTER TABLE trajectories DETACH PARTITION %I', part);
    END IF;
    RETURN part;
END $$;

-- A job's events older than p_age_s or beyond its newest p_count (NULL: that limit is off), at
-- most p_batch of them, never one of the last hour nor the job's newest of each kind; returns
-- how many were deleted (the driver's retention pass). SECURITY DEFINER: the runtime role has
-- no DELETE on events, so this rule is the only way it can prune the audit log.
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
END $$;

-- Metadata retention (buffer.metadata_retention_steps): the row-level detail of the job's steps
-- (through_step, cut], at most p_max_steps of them, where cut is the newest step at least
-- p_keep_steps behind the last and committed more than p_min_age_s ago: the episodes those
-- steps consumed, with their samples, payloads and recorded calls, and the expired episodes
-- whose prompt was queued again that ended before the cut, are deleted and added to
-- compacted_episodes and compacted_steps (quarantined episodes stay, for inspection). Never a row an invariant of the checker
-- flags (a group not wholly consumed, trained beyond its staleness bound or whose prompt has
-- another trained or live episode, an expired episode not requeued): those stay for the
-- checker to report. Returns the episodes deleted. SECURITY DEFINER: the runtime role has no
-- DELETE on episodes or trajectories, so this rule is the only way it can remove them.
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
END $$;

-- One claim attempt in one statement (run in autocommit): the task lock is held only while the
-- function runs. Every statement of a VOLATILE function sees a fresh snapshot, so the count of
-- leased episodes taken after the task lock includes every lease committed before it.
-- p_wait = false: tasks whose lock is held elsewhere are skipped (returned in ``skipped``) and
-- the function never waits, so it may hold several task locks; p_wait = true: one task, waited
-- for. Either way no claimer waits while holding a lock another claimer waits for. A queued
-- episode is not claimed before its retry_at, nor by the worker its last run failed on before
-- failed_worker_retry_at (another node gets the first chance).
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
END $$;

-- One sample's checkpoint (p_commit = false) or commit (p_commit = true) in one statement, fenced
-- by the lease epoch: FOR SHARE lets a group's samples checkpoint concurrently while blocking a
-- requeue; FOR UPDATE serialises commits of one group, so exactly one of them sees the group
-- whole and completes the episode. A committed sample is never overwritten.
-- The payload arguments hold tokens [p_start, p_num_tokens) only: segments at or past p_start
-- are replaced, earlier ones kept; the segment before p_start must end at p_start, else
-- nothing is written (outcome rebase: write again from 0). p_journal (a JSON array, or NULL for
-- a sample with no journal apart) holds the agent journal's entries from p_journal_start on;
-- at least that many must be stored (else outcome rebase_journal: write the whole journal);
-- stored entries from p_journal_start on are replaced (deleted, then inserted: no speculative
-- insertion per entry, migration 0012).
-- Outcomes: written, already (committed before: an idempotent repeat), stale (the lease moved
-- on: nothing written), rebase, rebase_journal.
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
            DELETE FROM agent_journal j
            WHERE j.task_id = ep.task_id AND j.episode_id = p_episode
              AND j.sample_index = p_sample AND j.seq >= p_journal_start;
            INSERT INTO agent_journal (task_id, episode_id, sample_index, seq, lease_epoch, entry)
            SELECT ep.task_id, p_episode, p_sample, p_journal_start + c.i::integer - 1, p_epoch,
                   c.entry
            FROM jsonb_array_elements(p_journal) WITH ORDINALITY AS c(entry, i);
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
END $$;

-- -- data -------------------------------------------------------------------------------------

INSERT INTO jobs (name) VALUES ('default');
