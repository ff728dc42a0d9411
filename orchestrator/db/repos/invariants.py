"""The queries of the invariant checker: each returns the rows that violate one invariant of
docs/architecture.md for a job (at most ``limit``), so an empty result means the invariant
holds.

They read the job's live rows, which metadata retention bounds (``rollcall_compact_steps``
never compacts a row a check would flag, so the live rows hold every violation), and the
compacted totals where a check counts over the whole job (``trained_once``: the samples its
steps trained against those consumed, compacted ones included)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

# name -> (what it checks, the violating rows for job :j, at most :limit; :through is the last
# step metadata retention compacted, -1 for none: InvariantRepository.violations reads it)
CHECKS: dict[str, tuple[str, str]] = {
    "episode_state": (
        "every episode is in one state and its samples agree with it",
        """
        SELECT e.id, e.status::text AS status, e.consumed_step, count(tr.*) AS samples,
               count(*) FILTER (WHERE tr.status = 'consumed') AS consumed,
               count(*) FILTER (WHERE tr.status IN ('ready', 'claimed')) AS finished
        FROM episodes e LEFT JOIN trajectories tr ON tr.task_id = e.task_id AND tr.episode_id = e.id
        WHERE e.job_id = :j
        GROUP BY e.id
        HAVING (e.consumed_step IS NOT NULL AND (e.status <> 'done'
                 OR count(*) FILTER (WHERE tr.status = 'consumed') <> e.group_size))
            OR (e.consumed_step IS NULL AND count(*) FILTER (WHERE tr.status = 'consumed') > 0)
            OR (e.status = 'done' AND e.consumed_step IS NULL
                AND count(*) FILTER (WHERE tr.status IN ('ready', 'claimed')) <> e.group_size)
            OR (e.status IN ('queued', 'leased')
                AND count(*) FILTER (WHERE tr.status IN ('claimed', 'consumed')) > 0)
        LIMIT :limit
        """,
    ),
    "trained_once": (
        "no prompt is trained twice and every consumed sample is counted by exactly one step",
        """
        SELECT task_id, prompt_index, count(*) AS consumed_episodes FROM episodes
        WHERE job_id = :j AND consumed_step IS NOT NULL
        GROUP BY task_id, prompt_index HAVING count(*) > 1
        UNION ALL
        SELECT NULL, NULL, abs(t.stepped - t.consumed) FROM (
            SELECT coalesce(c.step_trajectories, 0) + (
                       SELECT coalesce(sum(s.num_trajectories), 0) FROM train_steps s
                       WHERE s.job_id = :j AND s.step > :through
                   ) AS stepped,
                   coalesce(c.consumed_trajectories, 0) + (
                       SELECT count(*) FROM trajectories tr JOIN episodes e
                         ON e.id = tr.episode_id AND e.task_id = tr.task_id
                       WHERE e.job_id = :j AND tr.status = 'consumed'
                   ) AS consumed
            FROM (SELECT 1) one LEFT JOIN compacted_steps c ON c.job_id = :j
        ) t
        WHERE t.stepped <> t.consumed
        LIMIT :limit
        """,
    ),
    "staleness": (
        "nothing was trained beyond its task's staleness bound",
        """
        SELECT e.id, t.name, e.consumed_step, e.min_policy_version, t.max_staleness
        FROM episodes e JOIN tasks t ON t.id = e.task_id
        WHERE e.job_id = :j AND e.consumed_step IS NOT NULL
          AND e.consumed_step - e.min_policy_version > t.max_staleness
        LIMIT :limit
        """,
    ),
    "dead_leases": (
        "no lease is held by a worker that is dead, failed or stopped",
        """
        SELECT e.id, e.lease_owner, w.status::text AS worker_status FROM episodes e
        JOIN workers w ON w.id = e.lease_owner
        WHERE e.job_id = :j AND e.status = 'leased' AND w.status IN ('dead', 'failed', 'stopped')
        LIMIT :limit
        """,
    ),
    "inflight_cap": (
        "no task has more episodes leased than its max_inflight",
        """
        SELECT t.name, count(e.*) AS leased, t.max_inflight FROM tasks t
        JOIN episodes e ON e.task_id = t.id AND e.status = 'leased'
        WHERE t.job_id = :j GROUP BY t.id HAVING count(e.*) > t.max_inflight
        LIMIT :limit
        """,
    ),
    "expired_requeued": (
        "every expired episode's prompt was queued again as a newer episode",
        """
        SELECT e.id, e.task_id, e.prompt_index FROM episodes e
        WHERE e.job_id = :j AND e.status = 'expired' AND NOT EXISTS (
            SELECT 1 FROM episodes n WHERE n.task_id = e.task_id
              AND n.prompt_index = e.prompt_index AND n.id > e.id)
        LIMIT :limit
        """,
    ),
}


_THROUGH = text("SELECT through_step FROM compacted_steps WHERE job_id = :j")


class InvariantRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def violations(self, job_id: int, check: str, limit: int = 20) -> list[dict[str, Any]]:
        sql = CHECKS[check][1]
        # the last compacted step as a value, not a join's column: planned with it, the range
        # of steps after it is an index scan (as a column, a scan of every step: 28 ms at a
        # week's 90,000 steps)
        through = self.session.execute(_THROUGH, {"j": job_id}).scalar()
        params = {"j": job_id, "limit": limit, "through": -1 if through is None else through}
        rows = self.session.execute(text(sql), params).all()
        return [dict(r._asdict()) for r in rows]

    def samples_of_worker(self, worker_id: int) -> list[dict[str, Any]]:
        """The samples of every episode the worker holds a lease on, with their progress."""
        rows = self.session.execute(
            text(
                """
                SELECT e.id AS episode_id, e.task_id, tr.sample_index, tr.status::text AS status,
                       tr.num_turns, tr.num_tokens,
                       COALESCE(tr.journal_calls,
                           CASE jsonb_typeof(tr.env_state->'state'->'journal')
                                WHEN 'array'
                                THEN jsonb_array_length(tr.env_state->'state'->'journal')
                                ELSE 0 END) AS agent_calls
                FROM episodes e
                LEFT JOIN trajectories tr ON tr.task_id = e.task_id AND tr.episode_id = e.id
                WHERE e.lease_owner = :w AND e.status = 'leased'
                ORDER BY e.id, tr.sample_index
                """
            ),
            {"w": worker_id},
        ).all()
        return [dict(r._asdict()) for r in rows]

    def samples_of_episodes(self, episode_ids: list[int]) -> list[dict[str, Any]]:
        rows = self.session.execute(
            text(
                """
                SELECT e.id AS episode_id, e.status::text AS episode_status, tr.sample_index,
                       tr.status::text AS status, tr.num_turns, tr.num_tokens,
                       COALESCE((tr.reward_info->'calls'->>'replayed')::int, 0) AS agent_replayed
                FROM episodes e
                LEFT JOIN trajectories tr ON tr.task_id = e.task_id AND tr.episode_id = e.id
                WHERE e.id = ANY(:ids) ORDER BY e.id, tr.sample_index
                """
            ),
            {"ids": episode_ids},
        ).all()
        return [dict(r._asdict()) for r in rows]

    def workers_ended_since(self, job_id: int, since_epoch_s: float) -> int:
        """Worker incarnations of the job that ended dead or failed after ``since`` (epoch
        seconds): the chaos run's deaths, to compare with the faults it aimed at workers."""
        return int(
            self.session.execute(
                text(
                    "SELECT count(*) FROM workers WHERE job_id = :j "
                    "AND status IN ('dead', 'failed') AND stopped_at >= to_timestamp(:t)"
                ),
                {"j": job_id, "t": since_epoch_s},
            ).scalar_one()
        )

    def events_since(self, job_id: int, kind: str, since_epoch_s: float) -> int:
        return int(
            self.session.execute(
                text(
                    "SELECT count(*) FROM events WHERE job_id = :j AND kind = :k "
                    "AND created_at >= to_timestamp(:t)"
                ),
                {"j": job_id, "k": kind, "t": since_epoch_s},
            ).scalar_one()
        )
