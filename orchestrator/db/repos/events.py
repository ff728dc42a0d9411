"""The audit log: append and read events, and its retention (``drop_old``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from rollcall.orchestrator.db import jsontext
from rollcall.orchestrator.db.models import Event
from rollcall.orchestrator.domain import EventView

# The retention rule is the database's (rollcall_drop_old_events, migration 0010): the runtime
# role may delete events only through it. Events of the last hour are never dropped, whatever
# the count (readers of recent events: the user-error reports' cursor, `rollcall job events
# --since`, a drill's or chaos run's window), nor a job's newest event of each kind (the
# driver's metrics address, the last pause of a task, the last drill of each kind).
_DROP_OLD = text(
    "SELECT rollcall_drop_old_events(CAST(:j AS bigint), CAST(:age_s AS double precision), "
    "CAST(:count AS bigint), CAST(:batch AS integer))"
)


def event_view(e: Event) -> EventView:
    return EventView(
        id=e.id,
        kind=e.kind,
        actor=e.actor,
        message=e.message,
        job_id=e.job_id,
        task_id=e.task_id,
        payload=dict(e.payload or {}),
        created_at=e.created_at,
    )


class EventRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def add(
        self,
        kind: str,
        actor: str,
        message: str,
        *,
        job_id: int | None = None,
        task_id: int | None = None,
        worker_id: int | None = None,
        payload: dict[str, Any] | None = None,
    ) -> EventView:
        ev = Event(
            kind=kind,
            actor=actor,
            message=jsontext.plain_text(message),
            job_id=job_id,
            task_id=task_id,
            worker_id=worker_id,
            payload=payload or {},
        )
        self.session.add(ev)
        self.session.flush()
        self.session.refresh(ev)
        return event_view(ev)

    def after(
        self, job_id: int, after_id: int, kinds: tuple[str, ...], limit: int = 500
    ) -> list[EventView]:
        """The job's events of ``kinds`` with an id above ``after_id``, oldest first."""
        q = (
            select(Event)
            .where(Event.job_id == job_id, Event.id > after_id, Event.kind.in_(kinds))
            .order_by(Event.id)
            .limit(limit)
        )
        return [event_view(e) for e in self.session.scalars(q)]

    def drop_old(
        self, job_id: int, age_s: float | None, count: int | None, batch: int = 10_000
    ) -> int:
        """Retention of the job's audit log (``control_plane.event_retention_s``,
        ``event_retention_count``): delete its events older than ``age_s`` and those beyond
        its newest ``count`` (None: that limit is off), at most ``batch``, never one of the
        last hour nor the job's newest of each kind. Returns the events deleted."""
        if age_s is None and count is None:
            return 0
        params = {"j": job_id, "age_s": age_s, "count": count, "batch": batch}
        return int(self.session.scalar(_DROP_OLD, params) or 0)

    def last_at(self, task_id: int, kind: str) -> datetime | None:
        """When the task's latest event of ``kind`` was recorded (None: never)."""
        return self.session.scalar(
            select(func.max(Event.created_at)).where(Event.task_id == task_id, Event.kind == kind)
        )

    def last_id(self) -> int:
        return int(self.session.scalar(select(func.coalesce(func.max(Event.id), 0))) or 0)

    def list(
        self,
        *,
        job_id: int | None = None,
        task_id: int | None = None,
        kind: str | None = None,
        since: datetime | None = None,
        limit: int = 100,
    ) -> list[EventView]:
        q = select(Event)
        if job_id is not None:
            q = q.where(Event.job_id == job_id)
        if task_id is not None:
            q = q.where(Event.task_id == task_id)
        if kind is not None:
            q = q.where(Event.kind.startswith(kind) if kind.endswith(".") else Event.kind == kind)
        if since is not None:
            q = q.where(Event.created_at >= since)
        q = q.order_by(Event.id.desc()).limit(limit)
        return [event_view(e) for e in reversed(list(self.session.scalars(q)))]
