"""Read-only aggregates for operators: ``rollcall status``, ``worker list``, ``buffer stats``,
``events`` and the Prometheus exporter. Nothing here writes; every age is measured on the
database clock. The aggregates scan a job's live episodes with ``GROUP BY`` and add what
metadata retention compacted (``compacted_episodes``, ``compacted_steps``): their cost follows
the retention window, not the job's age. Callers poll them every few seconds, not per claim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

# ``done`` episodes split by where they are in training; the other statuses as stored
_EPISODE_STATE = """
    CASE WHEN status = 'done' AND consumed_step IS NOT NULL THEN 'consumed'
         WHEN status = 'done' AND claimed_step IS NOT NULL THEN 'claimed'
         WHEN status = 'done' THEN 'ready'
         ELSE status::text END
"""
# what metadata retention compacted, by task and end state (the same columns)
_COMPACTED_STATES = (
    "SELECT task_id, state AS s, sum(episodes) AS n, sum(samples) AS samples "
    "FROM compacted_episodes WHERE job_id = :j GROUP BY 1, 2"
)


@dataclass(frozen=True)
class JobProgress:
    id: int
    name: str
    status: str
    policy_version: int
    weights_version: int | None
    pending_step: int | None
    steps: int
    last_step_age_s: float | None


@dataclass(frozen=True)
class StepSummary:
    step: int
    at: float  # epoch seconds, database clock
    num_trajectories: int
    task_mix: dict[str, Any]
    metrics: dict[str, Any]


@dataclass(frozen=True)
class DrillCount:
    drill: str
    passed: bool
    count: int
    lost: int
    duplicated: int


@dataclass(frozen=True)
class UserErrorCount:
    count: int
    tasks: list[str]
    head: str  # what failed, without the input's details (``the agent raised RuntimeError``)
    location: str  # where in the user's code
    last_message: str  # the latest occurrence's event message
    last_at: Any


class MonitoringRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def latest_job_name(self) -> str | None:
        """The job with the most recent activity (a step, a heartbeat, or its creation)."""
        return self.session.execute(
            text(
                """
                SELECT j.name FROM jobs j
                ORDER BY greatest(
                    j.created_at,
                    (SELECT s.created_at FROM train_steps s WHERE s.job_id = j.id
                     ORDER BY s.step DESC LIMIT 1),
                    (SELECT max(last_heartbeat_at) FROM workers w WHERE w.job_id = j.id)
                ) DESC, j.id DESC
                LIMIT 1
                """
            )
        ).scalar_one_or_none()

    def job_progress(self, job_id: int) -> JobProgress:
        # the steps after the compacted ones (metadata retention), counted with the last
        # compacted step as a value: an index range, not a scan of every step
        through = self.session.execute(
            text("SELECT through_step FROM compacted_steps WHERE job_id = :j"), {"j": job_id}
        ).scalar()
        r = self.session.execute(
            text(
                """
                SELECT j.id, j.name, j.status::text AS status, j.policy_version,
                       j.weights_version, j.pending_step,
                       coalesce(c.steps, 0) + (
                           SELECT count(*) FROM train_steps s WHERE s.job_id = j.id
                             AND s.step > :through) AS steps,
                       extract(epoch FROM now() - (SELECT s.created_at FROM train_steps s
                                                   WHERE s.job_id = j.id
                                                   ORDER BY s.step DESC LIMIT 1)) AS age
                FROM jobs j LEFT JOIN compacted_steps c ON c.job_id = j.id WHERE j.id = :j
                """
            ),
            {"j": job_id, "through": -1 if through is None else through},
        ).one()
        return JobProgress(
            r.id,
            r.name,
            r.status,
            r.policy_version,
            r.weights_version,
            r.pending_step,
            int(r.steps),
            None if r.age is None else float(r.age),
        )

    def episode_states(self, job_id: int) -> dict[tuple[int, str], tuple[int, int]]:
        """(task id, state) -> (episodes, samples) where a state is a status with ``done``
        split into ``ready``, ``claimed`` (by an uncommitted step) and ``consumed``; the
        live episodes and those metadata retention compacted."""
        rows = self.session.execute(
            text(
                "SELECT task_id, s, sum(n) AS n, sum(samples) AS samples FROM ("
                f"SELECT task_id, {_EPISODE_STATE} AS s, count(*) AS n, "
                "coalesce(sum(group_size), 0) AS samples "
                "FROM episodes WHERE job_id = :j GROUP BY 1, 2 "
                f"UNION ALL {_COMPACTED_STATES}) x GROUP BY 1, 2"
            ),
            {"j": job_id},
        ).all()
        return {(r.task_id, r.s): (int(r.n), int(r.samples)) for r in rows}

    def trained_staleness(self, job_id: int) -> dict[int, dict[int, int]]:
        """Per task, trained groups by staleness (the consuming step minus the oldest policy
        version among the group's turns)."""
        rows = self.session.execute(
            text(
                "SELECT task_id, lag, sum(n) AS n FROM ("
                "SELECT task_id, consumed_step - min_policy_version AS lag, count(*) AS n "
                "FROM episodes WHERE job_id = :j AND consumed_step IS NOT NULL "
                "AND min_policy_version IS NOT NULL GROUP BY 1, 2 "
                "UNION ALL SELECT task_id, staleness, episodes FROM compacted_episodes "
                "WHERE job_id = :j AND state = 'consumed' AND staleness >= 0"
                ") x GROUP BY 1, 2"
            ),
            {"j": job_id},
        ).all()
        out: dict[int, dict[int, int]] = {}
        for r in rows:
            out.setdefault(r.task_id, {})[int(r.lag)] = int(r.n)
        return out

    def ready_staleness(self, job_id: int) -> dict[int, tuple[int, float]]:
        """Per task, the finished groups waiting for the trainer: (oldest one's staleness in
        versions, its age in seconds)."""
        rows = self.session.execute(
            text(
                """
                SELECT e.task_id, max(j.policy_version - e.min_policy_version) AS lag,
                       extract(epoch FROM now() - min(e.finished_at)) AS age
                FROM episodes e JOIN jobs j ON j.id = e.job_id
                WHERE e.job_id = :j AND e.status = 'done' AND e.consumed_step IS NULL
                  AND e.claimed_step IS NULL
                GROUP BY 1
                """
            ),
            {"j": job_id},
        ).all()
        return {r.task_id: (int(r.lag or 0), float(r.age or 0.0)) for r in rows}

    def recent_steps(self, job_id: int, limit: int) -> list[StepSummary]:
        """The last ``limit`` committed steps, oldest first."""
        rows = self.session.execute(
            text(
                "SELECT step, extract(epoch FROM created_at) AS at, num_trajectories, task_mix, "
                "metrics FROM train_steps WHERE job_id = :j ORDER BY step DESC LIMIT :n"
            ),
            {"j": job_id, "n": limit},
        ).all()
        return [_step(r) for r in reversed(rows)]

    def steps_after(self, job_id: int, step: int, limit: int = 1000) -> list[StepSummary]:
        rows = self.session.execute(
            text(
                "SELECT step, extract(epoch FROM created_at) AS at, num_trajectories, task_mix, "
                "metrics FROM train_steps WHERE job_id = :j AND step > :s ORDER BY step LIMIT :n"
            ),
            {"j": job_id, "s": step, "n": limit},
        ).all()
        return [_step(r) for r in rows]

    def last_step_number(self, job_id: int) -> int:
        """The last committed step, -1 before the first."""
        return int(
            self.session.execute(
                text("SELECT coalesce(max(step), -1) FROM train_steps WHERE job_id = :j"),
                {"j": job_id},
            ).scalar_one()
        )

    def event_counts(self, job_id: int) -> dict[str, int]:
        rows = self.session.execute(
            text("SELECT kind, count(*) FROM events WHERE job_id = :j GROUP BY kind"),
            {"j": job_id},
        ).all()
        return {r[0]: int(r[1]) for r in rows}

    def drill_counts(self, job_id: int) -> list[DrillCount]:
        """``drill.completed`` events by drill (its first word, e.g. ``kill-rollout``) and
        outcome, with the samples they lost or duplicated."""
        rows = self.session.execute(
            text(
                """
                SELECT split_part(payload->>'drill', ' ', 1) AS drill,
                       coalesce((payload->>'passed')::boolean, false) AS passed,
                       count(*) AS n,
                       coalesce(sum((payload->>'lost')::int), 0) AS lost,
                       coalesce(sum((payload->>'duplicated')::int), 0) AS duplicated
                FROM events WHERE job_id = :j AND kind = 'drill.completed'
                GROUP BY 1, 2 ORDER BY 1, 2
                """
            ),
            {"j": job_id},
        ).all()
        return [
            DrillCount(r.drill, r.passed, int(r.n), int(r.lost), int(r.duplicated)) for r in rows
        ]

    def user_errors(self, job_id: int, limit: int = 5) -> list[UserErrorCount]:
        """User-code failures (``episode.user_error`` events) by signature, the most frequent
        first: how often, and the latest one's message and place in the user's code."""
        rows = self.session.execute(
            text(
                """
                SELECT g.n, g.tasks, e.message, e.payload->>'location' AS location,
                       e.payload->>'head' AS head, e.created_at
                FROM (
                    SELECT payload->>'signature' AS sig, count(*) AS n, max(id) AS last_id,
                           array_agg(DISTINCT payload->>'task') AS tasks
                    FROM events WHERE job_id = :j AND kind = 'episode.user_error'
                    GROUP BY 1
                ) g JOIN events e ON e.id = g.last_id
                ORDER BY g.n DESC, g.last_id DESC LIMIT :n
                """
            ),
            {"j": job_id, "n": limit},
        ).all()
        return [
            UserErrorCount(
                count=int(r.n),
                tasks=[str(t) for t in r.tasks if t is not None],
                head=r.head or "",
                location=r.location or "",
                last_message=r.message,
                last_at=r.created_at,
            )
            for r in rows
        ]

    def incarnations(self, job_id: int) -> list[dict[str, Any]]:
        """Every worker incarnation of the job (``worker list --all``), newest last."""
        rows = self.session.execute(
            text(
                """
                SELECT id, name, role::text AS role, status::text AS status, incarnation,
                       host, pid, node_id, restarts, loaded_version, tokens_generated,
                       started_at, stopped_at,
                       extract(epoch FROM now() - last_heartbeat_at) AS heartbeat_age_s,
                       extract(epoch FROM now() - last_progress_at) AS progress_age_s
                FROM workers WHERE job_id = :j ORDER BY name, incarnation
                """
            ),
            {"j": job_id},
        ).all()
        return [
            {
                **r._asdict(),
                "heartbeat_age_s": float(r.heartbeat_age_s),
                "progress_age_s": float(r.progress_age_s),
            }
            for r in rows
        ]


def _step(r: Any) -> StepSummary:
    return StepSummary(
        step=int(r.step),
        at=float(r.at),
        num_trajectories=int(r.num_trajectories),
        task_mix=dict(r.task_mix or {}),
        metrics=dict(r.metrics or {}),
    )
