"""Workers: one row per incarnation of a rollout node or trainer rank."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from rollcall.orchestrator.db import jsontext
from rollcall.orchestrator.domain import WorkerRole, WorkerStatus


@dataclass(frozen=True)
class WorkerView:
    id: int
    job_id: int
    role: WorkerRole
    name: str
    incarnation: int
    status: WorkerStatus
    last_heartbeat_at: datetime
    loaded_version: int | None


class WorkerRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def register(
        self,
        *,
        job_id: int,
        role: WorkerRole,
        name: str,
        host: str | None = None,
        pid: int | None = None,
        node_id: str | None = None,
        info: dict[str, Any] | None = None,
        status: WorkerStatus = WorkerStatus.ALIVE,
    ) -> WorkerView:
        """A new incarnation of the slot ``name`` (incarnation = previous + 1), ``status`` now
        (``starting``: a rollout node that registers before its engine is up; it beats, and is
        judged by its heartbeat only until ``mark_alive``). ``info``: what the worker says of
        itself (a vLLM node: its engine's process ids)."""
        row = self.session.execute(
            text(
                """
                INSERT INTO workers (job_id, role, name, incarnation, status, host, pid, node_id,
                                     restarts, info)
                SELECT :j, CAST(:role AS worker_role), CAST(:name AS varchar),
                       coalesce(max(incarnation) + 1, 0), CAST(:status AS worker_status),
                       :host, :pid, :node,
                       coalesce(max(incarnation) + 1, 0), CAST(:info AS jsonb)
                FROM workers WHERE job_id = :j AND name = CAST(:name AS varchar)
                RETURNING id, job_id, role::text, name, incarnation, status::text,
                          last_heartbeat_at, loaded_version
                """
            ),
            {
                "j": job_id,
                "role": role.value,
                "name": name,
                "host": host,
                "pid": pid,
                "node": node_id,
                "info": jsontext.dumps(info or {}),
                "status": status.value,
            },
        ).one()
        return _view(row)

    def mark_alive(self, worker_id: int, info: dict[str, Any] | None = None) -> bool:
        """A starting worker is up: ``alive`` from now, its progress clock starting now, and
        ``info`` merged into what it said of itself. False: it was declared dead meanwhile."""
        row = self.session.execute(
            text(
                """
                UPDATE workers SET status = 'alive', last_heartbeat_at = now(),
                    last_progress_at = now(), info = info || CAST(:info AS jsonb)
                WHERE id = :w AND status IN ('starting', 'alive')
                RETURNING id
                """
            ),
            {"w": worker_id, "info": jsontext.dumps(info or {})},
        ).one_or_none()
        return row is not None

    def info(self, worker_id: int) -> dict[str, Any]:
        """What the worker said of itself when it registered."""
        got = self.session.execute(
            text("SELECT info FROM workers WHERE id = :w"), {"w": worker_id}
        ).scalar_one_or_none()
        return dict(got or {})

    def heartbeat(
        self,
        worker_id: int,
        tokens_generated: int = 0,
        loaded_version: int | None = None,
        progress: bool = False,
    ) -> bool:
        """Record liveness, and progress when tokens were generated or ``progress`` (a probe or
        a weight load completed), and the policy version the worker holds when given. False:
        declared dead."""
        row = self.session.execute(
            text(
                """
                UPDATE workers SET last_heartbeat_at = now(),
                    tokens_generated = tokens_generated + :n,
                    last_progress_at = CASE WHEN :n > 0 OR :p THEN now()
                                            ELSE last_progress_at END,
                    loaded_version = coalesce(CAST(:v AS integer), loaded_version)
                WHERE id = :w AND status IN ('starting', 'alive')
                RETURNING id
                """
            ),
            {"w": worker_id, "n": tokens_generated, "v": loaded_version, "p": progress},
        ).one_or_none()
        return row is not None

    def set_status(self, worker_id: int, status: WorkerStatus, reason: str | None = None) -> None:
        """``reason``: why (kept with the row, ``status_reason``); None keeps the one it has
        (the first word on a death is the true one: the supervisor's requeue that follows a
        breaker's give-back must not replace it)."""
        self.session.execute(
            text(
                "UPDATE workers SET status = CAST(:s AS worker_status), "
                "status_reason = COALESCE(CAST(:r AS text), status_reason), "
                "stopped_at = CASE WHEN :s IN ('dead', 'failed', 'stopped') THEN now() "
                "ELSE stopped_at END WHERE id = :w"
            ),
            {"w": worker_id, "s": status.value, "r": reason},
        )

    def db_now(self) -> Any:
        return self.session.execute(text("SELECT now()")).scalar_one()

    def lock_overdue(
        self,
        job_id: int,
        heartbeat_timeout_s: float,
        progress_timeout_s: float,
        *,
        since: Any = None,
    ) -> list[dict[str, Any]]:
        """Live workers whose heartbeat, or (rollout nodes that are up) progress, is overdue. A
        node still ``starting`` is judged by its heartbeat only: its engine is loading.
        ``since`` (a database time, after an outage): no age counts from before it."""
        rows = self.session.execute(
            text(
                """
                SELECT id, name, role::text AS role, incarnation,
                       extract(epoch FROM now() - last_heartbeat_at) AS heartbeat_age_s,
                       extract(epoch FROM now() - last_progress_at) AS progress_age_s,
                       now() - GREATEST(last_heartbeat_at, CAST(:since AS timestamptz))
                           > make_interval(secs => :hb) AS heartbeat_overdue
                FROM workers
                WHERE job_id = :j AND status IN ('starting', 'alive')
                  AND (now() - GREATEST(last_heartbeat_at, CAST(:since AS timestamptz))
                           > make_interval(secs => :hb)
                       OR (role = 'rollout' AND status = 'alive'
                           AND now() - GREATEST(last_progress_at, CAST(:since AS timestamptz))
                               > make_interval(secs => :pg)))
                ORDER BY id FOR UPDATE SKIP LOCKED
                """
            ),
            {"j": job_id, "hb": heartbeat_timeout_s, "pg": progress_timeout_s, "since": since},
        ).all()
        out = []
        for r in rows:
            hb, pg = float(r.heartbeat_age_s), float(r.progress_age_s)
            reason = (
                f"no heartbeat for {hb:.1f} s"
                if r.heartbeat_overdue
                else f"no generation progress for {pg:.1f} s"
            )
            out.append(
                {
                    "id": r.id,
                    "name": r.name,
                    "role": r.role,
                    "incarnation": r.incarnation,
                    "heartbeat_age_s": round(hb, 3),
                    "progress_age_s": round(pg, 3),
                    "reason": reason,
                }
            )
        return out

    def health(self, job_id: int) -> list[dict[str, Any]]:
        """The latest incarnation of every worker slot of the job, with its heartbeat and
        progress ages on the database clock."""
        rows = self.session.execute(
            text(
                """
                SELECT DISTINCT ON (name) id, name, role::text AS role, status::text AS status,
                       host, pid, node_id,
                       incarnation, restarts, loaded_version, tokens_generated, status_reason,
                       info->>'tool_sandbox' AS tool_sandbox,
                       extract(epoch FROM now() - last_heartbeat_at) AS heartbeat_age_s,
                       extract(epoch FROM now() - last_progress_at) AS progress_age_s
                FROM workers WHERE job_id = :j ORDER BY name, incarnation DESC
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

    def get(self, worker_id: int) -> WorkerView | None:
        row = self.session.execute(
            text(
                "SELECT id, job_id, role::text, name, incarnation, status::text, "
                "last_heartbeat_at, loaded_version FROM workers WHERE id = :w"
            ),
            {"w": worker_id},
        ).one_or_none()
        return _view(row) if row else None

    def diagnose(self, worker_id: int) -> dict[str, Any] | None:
        """What the control plane sees of a worker that was not declared dead in time (a drill
        that waited in vain): its status and the ages of its last beat and progress, whether
        another session holds a lock on its row (the dead-worker sweep skips locked rows), and
        the sessions idle inside a transaction on this database (how many, the longest). The
        lock probe locks the row for the rest of this (short) transaction when it is free."""
        row = self.session.execute(
            text(
                """
                SELECT status::text AS status,
                       extract(epoch FROM now() - last_heartbeat_at) AS heartbeat_age_s,
                       extract(epoch FROM now() - last_progress_at) AS progress_age_s
                FROM workers WHERE id = :w
                """
            ),
            {"w": worker_id},
        ).one_or_none()
        if row is None:
            return None
        free = self.session.execute(
            text("SELECT id FROM workers WHERE id = :w FOR UPDATE SKIP LOCKED"), {"w": worker_id}
        ).one_or_none()
        idle = self.session.execute(
            text(
                """
                SELECT count(*) AS n,
                       coalesce(max(extract(epoch FROM now() - state_change)), 0) AS longest_s
                FROM pg_stat_activity
                WHERE datname = current_database() AND state = 'idle in transaction'
                """
            )
        ).one()
        return {
            "status": row.status,
            "heartbeat_age_s": round(float(row.heartbeat_age_s), 1),
            "progress_age_s": round(float(row.progress_age_s), 1),
            "row_locked": free is None,
            "idle_in_transaction": int(idle.n),
            "idle_in_transaction_longest_s": round(float(idle.longest_s), 1),
        }


def _view(r: Any) -> WorkerView:
    return WorkerView(
        id=r.id,
        job_id=r.job_id,
        role=WorkerRole(r.role),
        name=r.name,
        incarnation=r.incarnation,
        status=WorkerStatus(r.status),
        last_heartbeat_at=r.last_heartbeat_at,
        loaded_version=r.loaded_version,
    )
