"""Episodes: seeding, claims, leases, requeue and quarantine.

Guarantees (with the callers in ``rollcall.orchestrator.buffer``):

- A claim (``rollcall_claim``, one statement) locks the task row, recounts the task's leased
  episodes under that lock and takes one queued episode with ``FOR UPDATE SKIP LOCKED``: no
  episode is leased twice at once, and a task never has more than ``max_inflight`` leased.
- Every claim bumps ``lease_epoch``; every requeue bumps it again, so a write by the previous
  holder is rejected (fencing).
- Lease expiry is judged on the database clock (``now()``), never a worker's.
- An episode claimed ``max_attempts`` times that fails again is ``quarantined`` (an end state),
  never requeued forever.

Deadlock freedom: task rows are locked ``FOR NO KEY UPDATE`` (so foreign-key checks, which
take ``KEY SHARE``, never wait on them); a claim either waits for nothing (SKIP LOCKED
everywhere) or waits for one task lock while holding none; seeding locks task rows in id
order and waits on no episode. Paths that lock episodes and then bump a task counter (sweep,
expiry) can wait for a claimer, but no claimer waits for them. A node's group commit locks its
batch's episodes in id order, and a heartbeat's renewal locks the node's leases in id order too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from rollcall.orchestrator.db import raw
from rollcall.orchestrator.db.jsontext import plain_text
from rollcall.orchestrator.db.models import Episode
from rollcall.orchestrator.quotas import TaskLoad


@dataclass(frozen=True)
class SeedRow:
    task_id: int
    name: str
    plugin: str
    spec: dict[str, Any]
    weight: float
    max_staleness: int
    prompt_cursor: int
    outstanding: int


@dataclass(frozen=True)
class LeasedRow:
    id: int
    task_id: int
    task_name: str
    plugin: str
    spec: dict[str, Any]
    prompt_index: int
    prompt: dict[str, Any]
    group_size: int
    lease_epoch: int
    attempts: int


@dataclass(frozen=True)
class Requeued:
    episode_id: int
    task_id: int
    quarantined: bool


_OUTSTANDING = "status IN ('queued', 'leased') OR (status = 'done' AND consumed_step IS NULL)"


class EpisodeRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    # -- seeding ---------------------------------------------------------------------------

    def lock_seedable_tasks(self, job_id: int) -> list[SeedRow]:
        """Active tasks of the job, locked (in id order), with their outstanding groups."""
        rows = self.session.execute(
            text(
                "SELECT id, name, plugin, spec, weight, max_staleness, prompt_cursor FROM tasks "
                "WHERE job_id = :job AND status = 'active' ORDER BY id FOR NO KEY UPDATE"
            ),
            {"job": job_id},
        ).all()
        if not rows:
            return []
        counts: dict[int, int] = dict(
            self.session.execute(
                text(
                    f"SELECT task_id, count(*) FROM episodes WHERE task_id = ANY(:ids) "
                    f"AND ({_OUTSTANDING}) GROUP BY task_id"
                ),
                {"ids": [r.id for r in rows]},
            ).all()
        )
        return [
            SeedRow(
                task_id=r.id,
                name=r.name,
                plugin=r.plugin,
                spec=dict(r.spec),
                weight=r.weight,
                max_staleness=r.max_staleness,
                prompt_cursor=r.prompt_cursor,
                outstanding=int(counts.get(r.id, 0)),
            )
            for r in rows
        ]

    def add_episodes(
        self,
        *,
        job_id: int,
        task_id: int,
        first_index: int,
        prompts: Sequence[dict[str, Any]],
        group_size: int,
        advance_cursor: bool = True,
    ) -> list[int]:
        """Queue one episode per prompt; advance the task's prompt cursor past them."""
        if not prompts:
            return []
        ids = self.session.scalars(
            insert(Episode)
            .values(
                [
                    {
                        "job_id": job_id,
                        "task_id": task_id,
                        "prompt_index": first_index + i,
                        "prompt": p,
                        "group_size": group_size,
                    }
                    for i, p in enumerate(prompts)
                ]
            )
            .returning(Episode.id)
        ).all()
        if advance_cursor:
            self.session.execute(
                text("UPDATE tasks SET prompt_cursor = :c WHERE id = :t"),
                {"c": first_index + len(prompts), "t": task_id},
            )
        return list(ids)

    # -- claims ----------------------------------------------------------------------------

    def task_loads(self, job_id: int, claim_window_s: float) -> list[TaskLoad]:
        """Claimable tasks (active or draining) with leased/queued counts and claim scores."""
        rows = (
            raw.cursor(self.session)
            .execute(
                """
            SELECT t.id, t.weight, t.max_inflight,
              (SELECT count(*) FROM episodes e
                WHERE e.task_id = t.id AND e.status = 'leased') AS leased,
              (SELECT count(*) FROM (SELECT 1 FROM episodes e
                WHERE e.task_id = t.id AND e.status = 'queued' LIMIT 64) q) AS queued,
              t.claim_score * exp(-greatest(extract(epoch FROM now() - t.claim_score_at), 0)
                / %(tau)s) AS score
            FROM tasks t
            WHERE t.job_id = %(job)s AND t.status IN ('active', 'draining')
            """,
                {"job": job_id, "tau": claim_window_s},
            )
            .fetchall()
        )
        return [
            TaskLoad(
                task_id=r.id,
                weight=r.weight,
                leased=int(r.leased),
                max_inflight=r.max_inflight,
                queued=int(r.queued),
                recent_claims=float(r.score),
            )
            for r in rows
        ]

    def claim(
        self,
        task_ids: Sequence[int],
        worker_id: int,
        lease_s: float,
        claim_window_s: float,
        *,
        wait: bool,
    ) -> tuple[LeasedRow | None, list[int]]:
        """Try the tasks in order and lease the oldest queued episode of the first one that is
        claimable and under its ``max_inflight`` (``rollcall_claim``: orchestrator/db/schema.sql).

        Run it in autocommit (``Database.autocommit()``): the task lock is then held only while
        the function runs. ``wait=False`` skips tasks whose lock another claimer holds and
        returns them; ``wait=True`` takes one task and waits for its lock."""
        assert wait is False or len(task_ids) == 1, "a waiting claim tries one task"
        row = (
            raw.cursor(self.session)
            .execute(
                "SELECT * FROM rollcall_claim(%(tasks)s, %(w)s, %(lease)s, %(tau)s, %(wait)s)",
                {
                    "tasks": list(task_ids),
                    "w": worker_id,
                    "lease": lease_s,
                    "tau": claim_window_s,
                    "wait": wait,
                },
            )
            .fetchone()
        )
        assert row is not None
        skipped = list(row.skipped or [])
        if row.outcome != "leased":
            return None, skipped
        return (
            LeasedRow(
                id=row.episode_id,
                task_id=row.task_id,
                task_name=row.task_name,
                plugin=row.plugin,
                spec=dict(row.spec),
                prompt_index=row.prompt_index,
                prompt=dict(row.prompt),
                group_size=row.group_size,
                lease_epoch=row.lease_epoch,
                attempts=row.attempts,
            ),
            skipped,
        )

    def renew(self, worker_id: int, lease_s: float) -> list[tuple[int, int]]:
        """Extend every lease the worker holds; returns (episode id, epoch) of each. The rows
        are locked in id order, as a node's group commit locks them (``write_batch``): a
        renewal and a batch of the same node's writes never wait on each other in a cycle."""
        rows = (
            raw.cursor(self.session)
            .execute(
                "UPDATE episodes SET lease_expires_at = now() + make_interval(secs => %(s)s) "
                "WHERE id IN (SELECT id FROM episodes WHERE lease_owner = %(w)s "
                "AND status = 'leased' ORDER BY id FOR NO KEY UPDATE) "
                "RETURNING id, lease_epoch",
                {"w": worker_id, "s": lease_s},
            )
            .fetchall()
        )
        return [(r.id, r.lease_epoch) for r in rows]

    def lock_lease(self, episode_id: int, epoch: int) -> Any | None:
        """The episode row if the lease (id, epoch) is still current, locked ``FOR UPDATE``;
        else None. After waiting for a concurrent requeue the row is re-checked, so a moved-on
        epoch is always seen. (Sample writes fence inside ``rollcall_write_sample``.)"""
        return (
            raw.cursor(self.session)
            .execute(
                "SELECT id, task_id, group_size, lease_owner, lease_epoch, attempts FROM episodes "
                "WHERE id = %(e)s AND lease_epoch = %(ep)s AND status = 'leased' FOR UPDATE",
                {"e": episode_id, "ep": epoch},
            )
            .fetchone()
        )

    def depth(self, job_id: int) -> dict[str, int]:
        rows = self.session.execute(
            text(
                """
                SELECT CASE WHEN status = 'done' AND consumed_step IS NOT NULL THEN 'consumed'
                            WHEN status = 'done' AND claimed_step IS NOT NULL THEN 'claimed'
                            WHEN status = 'done' THEN 'ready'
                            ELSE status::text END AS s, count(*) AS n
                FROM episodes WHERE job_id = :j GROUP BY 1
                UNION ALL
                SELECT state, sum(episodes) FROM compacted_episodes WHERE job_id = :j GROUP BY 1
                """
            ),
            {"j": job_id},
        ).all()
        out: dict[str, int] = {}
        for r in rows:  # live episodes, and those metadata retention compacted
            out[r[0]] = out.get(r[0], 0) + int(r[1])
        return out

    # -- requeue and quarantine --------------------------------------------------------------

    def lock_expired_leases(
        self, job_id: int, limit: int = 1000, *, held_until: Any = None
    ) -> list[Any]:
        """Leases expired on the database clock; with ``held_until`` (after an outage), none
        before that time."""
        return list(
            self.session.execute(
                text(
                    "SELECT id, task_id, attempts FROM episodes WHERE job_id = :job "
                    "AND status = 'leased' "
                    "AND GREATEST(lease_expires_at, CAST(:held AS timestamptz)) < now() "
                    "ORDER BY id LIMIT :n FOR UPDATE SKIP LOCKED"
                ),
                {"job": job_id, "n": limit, "held": held_until},
            ).all()
        )

    def lock_worker_leases(self, worker_id: int) -> list[Any]:
        return list(
            self.session.execute(
                text(
                    "SELECT id, task_id, attempts FROM episodes "
                    "WHERE lease_owner = :w AND status = 'leased' ORDER BY id FOR UPDATE"
                ),
                {"w": worker_id},
            ).all()
        )

    def requeue_or_quarantine(
        self, rows: Sequence[Any], max_attempts: int, error: str
    ) -> list[Requeued]:
        """Return leased episodes to the queue (epoch bumped), or quarantine those that have
        used ``max_attempts`` claims. Their in-progress samples stay for the next claimer;
        a quarantined episode's in-progress samples are expired."""
        out: list[Requeued] = []
        requeue = [r.id for r in rows if r.attempts < max_attempts]
        quarantine = [r for r in rows if r.attempts >= max_attempts]
        if requeue:
            self.session.execute(
                text(
                    "UPDATE episodes SET status = 'queued', lease_owner = NULL, "
                    "lease_expires_at = NULL, lease_epoch = lease_epoch + 1, last_error = :err, "
                    "updated_at = now() WHERE id = ANY(:ids)"
                ),
                {"ids": requeue, "err": plain_text(error)},
            )
            out += [Requeued(r.id, r.task_id, False) for r in rows if r.attempts < max_attempts]
        if quarantine:
            ids = [r.id for r in quarantine]
            self.session.execute(
                text(
                    "UPDATE episodes SET status = 'quarantined', lease_owner = NULL, "
                    "lease_expires_at = NULL, lease_epoch = lease_epoch + 1, last_error = :err, "
                    "finished_at = now(), updated_at = now() WHERE id = ANY(:ids)"
                ),
                {"ids": ids, "err": plain_text(error)},
            )
            self.session.execute(
                text(
                    "UPDATE trajectories SET status = 'expired', updated_at = now() "
                    "WHERE task_id = ANY(:tids) AND episode_id = ANY(:ids) "
                    "AND status = 'in_progress'"
                ),
                {"tids": sorted({r.task_id for r in quarantine}), "ids": ids},
            )
            out += [Requeued(r.id, r.task_id, True) for r in quarantine]
        return out

    def requeue_uncounted(self, rows: Sequence[Any], error: str) -> list[Requeued]:
        """Return leased episodes to the queue without counting the claim as an attempt (the
        holder's engine failed, not the episode): never quarantines."""
        ids = [r.id for r in rows]
        if ids:
            self.session.execute(
                text(
                    "UPDATE episodes SET status = 'queued', lease_owner = NULL, "
                    "lease_expires_at = NULL, lease_epoch = lease_epoch + 1, last_error = :err, "
                    "attempts = greatest(attempts - 1, 0), updated_at = now() "
                    "WHERE id = ANY(:ids)"
                ),
                {"ids": ids, "err": plain_text(error)},
            )
        return [Requeued(r.id, r.task_id, False) for r in rows]

    def set_retry(
        self, episode_id: int, *, delay_s: float, worker_id: int, worker_delay_s: float
    ) -> None:
        """A requeued episode whose user code failed: claimable ``delay_s`` from now, by the
        worker it failed on only ``worker_delay_s`` from now (``rollcall_claim``)."""
        self.session.execute(
            text(
                "UPDATE episodes SET retry_at = now() + make_interval(secs => :d), "
                "failed_worker = :w, "
                "failed_worker_retry_at = now() + make_interval(secs => :wd) WHERE id = :e"
            ),
            {"e": episode_id, "d": delay_s, "w": worker_id, "wd": worker_delay_s},
        )

    def bump_task_counter(self, task_id: int, counter: str, by: int = 1) -> None:
        assert counter in {
            "fenced_rejections",
            "expired_groups",
            "quarantined_episodes",
            "requeued_leases",
        }
        self.session.execute(
            text(f"UPDATE tasks SET {counter} = {counter} + :n WHERE id = :t"),
            {"n": by, "t": task_id},
        )
