"""Jobs: create, look up, list; the driver's hold on a job (epoch, status, liveness)."""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.sql.expression import bindparam

from rollcall.orchestrator.db.driver_lock import DRIVER_LOCK_NS
from rollcall.orchestrator.db.models import Job
from rollcall.orchestrator.domain import JobStatus, JobView
from rollcall.orchestrator.errors import ConflictError


def job_view(job: Job) -> JobView:
    return JobView(
        id=job.id,
        name=job.name,
        status=JobStatus(job.status),
        policy_version=job.policy_version,
        config=dict(job.config or {}),
        created_at=job.created_at,
        updated_at=job.updated_at,
        driver_epoch=int(job.driver_epoch or 0),
        driver=dict(job.driver) if job.driver else None,
    )


@dataclass(frozen=True)
class LiveDriver:
    """A driver lock held on the server: in which database, for which job id (and its name
    when that database is the one asked)."""

    database: str
    job_id: int
    job_name: str | None


# The driver lock of job :j in the current database, held by some session.
_DRIVER_HELD = """
    SELECT EXISTS (
        SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted
          AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND classid::bigint = :ns AND objid::bigint = :j AND objsubid = 2
    )
"""


class JobRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def get_by_name(self, name: str) -> JobView | None:
        job = self.session.scalar(select(Job).where(Job.name == name))
        return job_view(job) if job else None

    def get(self, job_id: int) -> JobView | None:
        job = self.session.get(Job, job_id)
        return job_view(job) if job else None

    def list(self) -> list[JobView]:
        return [job_view(j) for j in self.session.scalars(select(Job).order_by(Job.id))]

    def create(self, name: str, config: dict[str, Any] | None = None) -> JobView:
        job = Job(name=name, config=config or {})
        self.session.add(job)
        try:
            self.session.flush()
        except IntegrityError:
            raise ConflictError(
                f"a job named {name!r} already exists; choose another name"
            ) from None
        self.session.refresh(job)
        return job_view(job)

    # -- the driver's hold on the job ------------------------------------------------------

    def take_driver(self, job_id: int, info: dict[str, Any]) -> int:
        """The caller holds the job's driver lock: bump the driver epoch (fencing every earlier
        driver's step commits), mark the job running and record who drives it. Returns the new
        epoch."""
        return int(
            self.session.execute(
                text(
                    "UPDATE jobs SET driver_epoch = driver_epoch + 1, status = 'running', "
                    "driver = :info, updated_at = now() WHERE id = :j RETURNING driver_epoch"
                ).bindparams(bindparam("info", type_=JSONB)),
                {"j": job_id, "info": info},
            ).scalar_one()
        )

    def set_driver_status(self, job_id: int, epoch: int, status: str) -> bool:
        """Set the job's status as its driver of ``epoch``; False (nothing written) when
        another driver has taken the job since."""
        result = self.session.execute(
            text(
                "UPDATE jobs SET status = CAST(:s AS job_status), updated_at = now() "
                "WHERE id = :j AND driver_epoch = :e"
            ),
            {"j": job_id, "e": epoch, "s": status},
        )
        return int(result.rowcount) == 1  # type: ignore[attr-defined]

    def request_stop(self, job_id: int) -> bool:
        """A running job -> ``stopping`` (its driver polls the row). False if not running."""
        result = self.session.execute(
            text(
                "UPDATE jobs SET status = 'stopping', updated_at = now() "
                "WHERE id = :j AND status = 'running'"
            ),
            {"j": job_id},
        )
        return int(result.rowcount) == 1  # type: ignore[attr-defined]

    def driver_alive(self, job_id: int) -> bool:
        """Some session holds the job's driver lock: a driver is running it now."""
        return bool(
            self.session.execute(text(_DRIVER_HELD), {"ns": DRIVER_LOCK_NS, "j": job_id}).scalar()
        )

    def live_drivers(self) -> builtins.list[LiveDriver]:
        """Every driver lock held on the server, in any database."""
        rows = self.session.execute(
            text(
                """
                SELECT d.datname, l.objid::bigint AS job_id,
                       d.datname = current_database() AS here
                FROM pg_locks l JOIN pg_database d ON d.oid = l.database
                WHERE l.locktype = 'advisory' AND l.granted AND l.classid::bigint = :ns
                  AND l.objsubid = 2
                ORDER BY 1, 2
                """
            ),
            {"ns": DRIVER_LOCK_NS},
        ).all()
        names: dict[int, str] = {}
        if any(r.here for r in rows):
            names = {
                j.id: j.name
                for j in self.session.scalars(
                    select(Job).where(Job.id.in_([r.job_id for r in rows if r.here]))
                )
            }
        return [LiveDriver(r.datname, int(r.job_id), names.get(int(r.job_id))) for r in rows]
