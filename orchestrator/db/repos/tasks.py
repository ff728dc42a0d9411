"""Tasks of a job and their trajectory partitions.

Registration inserts the task and attaches its partition in the caller's transaction, so a
failure leaves neither behind; retirement detaches the partition (the rows stay, in a table
of their own). Partition DDL goes through SECURITY DEFINER functions (orchestrator/db/
schema.sql), so the runtime database role needs no CREATE privilege.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from rollcall.orchestrator.db.jsontext import plain_text
from rollcall.orchestrator.db.models import Episode, Job, Task, Trajectory, partition_name
from rollcall.orchestrator.domain import TaskCounts, TaskStatus, TaskView
from rollcall.orchestrator.errors import ConflictError


def task_view(task: Task, job_name: str) -> TaskView:
    return TaskView(
        id=task.id,
        job_id=task.job_id,
        job_name=job_name,
        name=task.name,
        plugin=task.plugin,
        spec=dict(task.spec or {}),
        weight=task.weight,
        max_inflight=task.max_inflight,
        max_staleness=task.max_staleness,
        status=TaskStatus(task.status),
        partition=partition_name(task.id),
        prompt_cursor=task.prompt_cursor,
        created_at=task.created_at,
        updated_at=task.updated_at,
        retired_at=task.retired_at,
        counters={
            "fenced_rejections": task.fenced_rejections,
            "expired_groups": task.expired_groups,
            "quarantined_episodes": task.quarantined_episodes,
            "requeued_leases": task.requeued_leases,
        },
        status_reason=task.status_reason,
    )


_REGISTRY_LOCK_NS = 0x54534B53  # "TSKS": advisory lock namespace of the task registry


class TaskRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def _views(self, rows: Any) -> list[TaskView]:
        return [task_view(t, jn) for t, jn in rows]

    def create(
        self,
        *,
        job_id: int,
        name: str,
        plugin: str,
        spec: dict[str, Any],
        weight: float,
        max_inflight: int,
        max_staleness: int,
    ) -> TaskView:
        self.lock_registry(job_id)
        task = Task(
            job_id=job_id,
            name=name,
            plugin=plugin,
            spec=spec,
            weight=weight,
            max_inflight=max_inflight,
            max_staleness=max_staleness,
        )
        self.session.add(task)
        try:
            self.session.flush()
        except IntegrityError as e:
            if "uq_tasks_job_id_name_live" in str(e.orig):
                raise ConflictError(
                    f"a task named {name!r} already exists in this job; choose another name or "
                    f"retire the existing one"
                ) from None
            raise
        self.session.execute(text("SELECT rollcall_attach_task_partition(:id)"), {"id": task.id})
        self.session.refresh(task)
        job_name = self.session.scalar(select(Job.name).where(Job.id == job_id))
        assert job_name is not None
        return task_view(task, job_name)

    def lock_registry(self, job_id: int) -> None:
        """Serialise registrations and retirements of one job (until the transaction ends).

        Creating or detaching a partition takes SHARE ROW EXCLUSIVE on ``tasks`` (the partition
        clones its foreign keys). Two registrations of one name would otherwise deadlock: each
        waits on the other's row for the unique name while holding the lock the other's DDL
        needs. Under this lock the second one sees the first's committed row and gets a clean
        "already exists"."""
        self.session.execute(
            text("SELECT pg_advisory_xact_lock(:ns, :job)"),
            {"ns": _REGISTRY_LOCK_NS, "job": job_id},
        )

    def get_by_name(self, job_id: int, name: str, *, for_update: bool = False) -> TaskView | None:
        q = (
            select(Task, Job.name)
            .join(Job, Job.id == Task.job_id)
            .where(Task.job_id == job_id, Task.name == name)
            .order_by(Task.status == TaskStatus.RETIRED, Task.id.desc())
            .limit(1)
        )
        if for_update:
            q = q.with_for_update(of=Task, key_share=True)
        rows = self._views(self.session.execute(q))
        return rows[0] if rows else None

    def get(self, task_id: int) -> TaskView | None:
        q = select(Task, Job.name).join(Job, Job.id == Task.job_id).where(Task.id == task_id)
        rows = self._views(self.session.execute(q))
        return rows[0] if rows else None

    def list(self, job_id: int | None = None, *, include_retired: bool = True) -> list[TaskView]:
        q = select(Task, Job.name).join(Job, Job.id == Task.job_id)
        if job_id is not None:
            q = q.where(Task.job_id == job_id)
        if not include_retired:
            q = q.where(Task.status != TaskStatus.RETIRED)
        return self._views(self.session.execute(q.order_by(Task.job_id, Task.id)))

    def set_status(self, task_id: int, status: TaskStatus) -> TaskView:
        """An operator's transition: whatever reason the task had for its status goes."""
        self.session.execute(
            update(Task).where(Task.id == task_id).values(status=status, status_reason=None)
        )
        view = self.get(task_id)
        assert view is not None
        return view

    def pause_with_reason(self, task_id: int, reason: str) -> str | None:
        """Pause an active or draining task, keeping ``reason``; returns the status it had, or
        None when it was neither (nothing changed)."""
        row = self.session.execute(
            text(
                "UPDATE tasks t SET status = 'paused', status_reason = :r, updated_at = now() "
                "FROM (SELECT id, status FROM tasks WHERE id = :t FOR NO KEY UPDATE) old "
                "WHERE t.id = old.id AND old.status IN ('active', 'draining') "
                "RETURNING old.status::text"
            ),
            {"t": task_id, "r": plain_text(reason)},
        ).first()
        return None if row is None else str(row[0])

    def set_quota(
        self,
        task_id: int,
        *,
        weight: float | None = None,
        max_inflight: int | None = None,
        max_staleness: int | None = None,
    ) -> TaskView:
        values: dict[str, Any] = {}
        if weight is not None:
            values["weight"] = weight
        if max_inflight is not None:
            values["max_inflight"] = max_inflight
        if max_staleness is not None:
            values["max_staleness"] = max_staleness
        if values:
            self.session.execute(update(Task).where(Task.id == task_id).values(**values))
        view = self.get(task_id)
        assert view is not None
        return view

    def retire(self, task_id: int) -> TaskView:
        """Mark retired and detach the task's partition (its rows are kept, detached)."""
        self.session.execute(
            update(Task)
            .where(Task.id == task_id)
            .values(status=TaskStatus.RETIRED, retired_at=func.now())
        )
        self.session.execute(text("SELECT rollcall_detach_task_partition(:id)"), {"id": task_id})
        view = self.get(task_id)
        assert view is not None
        return view

    def counts(self, task_id: int) -> TaskCounts:
        episodes = {
            str(s.value if hasattr(s, "value") else s): n
            for s, n in self.session.execute(
                select(Episode.status, func.count())
                .where(Episode.task_id == task_id)
                .group_by(Episode.status)
            )
        }
        attached = self.partition_attached(task_id)
        trajectories: dict[str, int] = {}
        if attached:
            trajectories = {
                str(s.value if hasattr(s, "value") else s): n
                for s, n in self.session.execute(
                    select(Trajectory.status, func.count())
                    .where(Trajectory.task_id == task_id)
                    .group_by(Trajectory.status)
                )
            }
        return TaskCounts(episodes=episodes, trajectories=trajectories, partition_attached=attached)

    def partition_attached(self, task_id: int) -> bool:
        return bool(
            self.session.scalar(
                text(
                    "SELECT EXISTS (SELECT 1 FROM pg_inherits i "
                    "JOIN pg_class c ON c.oid = i.inhrelid "
                    "JOIN pg_class p ON p.oid = i.inhparent "
                    "WHERE p.relname = 'trajectories' AND c.relname = :name)"
                ),
                {"name": partition_name(task_id)},
            )
        )

    def groups_reserved_by_trainer(self, task_id: int) -> int:
        return (
            self.session.scalar(
                select(func.count())
                .select_from(Episode)
                .where(
                    Episode.task_id == task_id,
                    Episode.claimed_step.is_not(None),
                    Episode.consumed_step.is_(None),
                )
            )
            or 0
        )

    def expire_untrained_groups(self, task_id: int) -> int:
        """Finished groups never trained -> expired (with their trajectories); counted."""
        ids = list(
            self.session.scalars(
                text(
                    "UPDATE episodes SET status = 'expired', updated_at = now() WHERE task_id = :t "
                    "AND status = 'done' AND consumed_step IS NULL RETURNING id"
                ),
                {"t": task_id},
            )
        )
        if ids:
            self.session.execute(
                text(
                    "UPDATE trajectories SET status = 'expired', updated_at = now() "
                    "WHERE task_id = :t AND episode_id = ANY(:ids) AND status = 'ready'"
                ),
                {"t": task_id, "ids": ids},
            )
            self.session.execute(
                text("UPDATE tasks SET expired_groups = expired_groups + :n WHERE id = :t"),
                {"t": task_id, "n": len(ids)},
            )
        return len(ids)

    def episodes_outstanding(self, task_id: int) -> int:
        """Episodes still queued or leased (work not yet finished)."""
        return (
            self.session.scalar(
                select(func.count())
                .select_from(Episode)
                .where(Episode.task_id == task_id, Episode.status.in_(["queued", "leased"]))
            )
            or 0
        )
