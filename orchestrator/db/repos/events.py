"""The audit log: append and read events, and its retention (``drop_old``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from rollcall.orchestrator.db import jsontext
from rollcall.orchestrator.db.models import Event
from rollcall.orchestrator.domain import EventView

# Events of the last hour are never dropped, whatever the count (readers of recent events:
# the user-error reports' cursor, `rollcall job events --since`, a drill's or chaos run's
# window), nor a job's newest event of each kind (the driver's metrics address, the last
# pause of a task, the last drill of each kind).
KEEP_RECENT_S = 3600.0

# A job's events older than :age_s, or beyond its newest :count, at most :batch of them,
# except those of the last :recent_s and its newest event of each kind; the condition that
# is off (age or count) is NULL. Ids grow with time (a sequence), so the newest :count are
# those above the (count + 1)-th newest id.
_DROP_OLD = text(
    """
    WITH newest_of_kind AS (
        SELECT max(id) AS id FROM events WHERE job_id = :j GROUP BY kind
    ), beyond_count AS (
        SELECT id FROM events WHERE job_id = :j AND CAST(:count AS bigint) IS NOT NULL
        ORDER BY id DESC OFFSET :count LIMIT 1
    ), doomed AS (
        SELECT id FROM events
        WHERE job_id = :j
          AND created_at < now() - make_interval(secs => :recent_s)
          AND (created_at < now() - make_interval(secs => CAST(:age_s AS double precision))
               OR id <= (SELECT id FROM beyond_count))
          AND id NOT IN (SELECT id FROM newest_of_kind)
        ORDER BY id LIMIT :batch
    )
    DELETE FROM events WHERE id IN (SELECT id FROM doomed)
    """
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
        last ``KEEP_RECENT_S`` nor the job's newest of each kind. Returns the events
        deleted."""
        if age_s is None and count is None:
            return 0
        result = self.session.execute(
            _DROP_OLD,
            {
                "j": job_id,
                "age_s": age_s,
                "count": count,
                "recent_s": KEEP_RECENT_S,
                "batch": batch,
            },
        )
        return int(result.rowcount or 0)  # type: ignore[attr-defined]

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
