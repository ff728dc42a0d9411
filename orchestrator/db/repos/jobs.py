"""Jobs: create, look up, list."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from orchestrator.db.models import Job
from orchestrator.domain import JobStatus, JobView
from orchestrator.errors import ConflictError


def job_view(job: Job) -> JobView:
    return JobView(
        id=job.id,
        name=job.name,
        status=JobStatus(job.status),
        policy_version=job.policy_version,
        config=dict(job.config or {}),
        created_at=job.created_at,
        updated_at=job.updated_at,
    )


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
