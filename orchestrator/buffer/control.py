"""The control plane's buffer: what the job driver's scheduler jobs and its supervisor do to
the buffer (``ControlPlaneBuffer``).

Seeding, the sweeps of expired leases and dead workers (and their view of database outages),
staleness expiry, payload retention, the rollout fleet's size and slots, the job's events,
tasks, depth and worker health.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from rollcall.orchestrator.buffer.base import ACTOR, BufferBase
from rollcall.orchestrator.buffer.timings import timed
from rollcall.orchestrator.buffer.types import SweepResult
from rollcall.orchestrator.config import BufferConfig
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.db.retry import CAP_S, retry_transient
from rollcall.orchestrator.domain import EventView, TaskView, WorkerStatus
from rollcall.orchestrator.inputs import bounded_prompt
from rollcall.orchestrator.quotas import SeedInput, seed_counts
from rollcall.tasks import registry
from rollcall.tasks.base import Task

log = logging.getLogger(__name__)

# Steps whose payloads one retention pass drops at most (a job that turns retention on late
# catches up over several passes instead of one long transaction).
RETENTION_STEPS_PER_PASS = 20
# Metadata retention (``buffer.metadata_retention_steps``) never compacts a step committed in
# the last hour, whatever the window: a drill's or a soak's accounting reads the rows of the
# episodes it watched minutes after the fault; and compacts at most this many steps per pass.
METADATA_MIN_AGE_S = 3_600.0
COMPACT_STEPS_PER_PASS = 50


@dataclass(frozen=True)
class DeadWorker:
    worker_id: int
    name: str
    reason: str
    swept: SweepResult


class ControlPlaneBuffer(BufferBase):
    def __init__(
        self,
        db: Database,
        job_id: int,
        config: BufferConfig | None = None,
        plugins: Callable[[str], Task] = registry.get,
        *,
        beside: BufferBase | None = None,
    ) -> None:
        super().__init__(db, job_id, config, beside=beside)
        self._plugins = plugins
        # rollout.input_limits.prompt_bytes (the driver's seeder): a longer prompt row is seeded
        # as a marker its node fails as the input's fault (``rollcall.orchestrator.inputs``)
        self.prompt_bytes: int | None = None
        self._last_dead_sweep: Any = None
        # The sweeps' view of outages (database clock): when they last saw one end.
        self._outage_lock = threading.Lock()
        self._outage_end: Any = None
        self._failures_seen = 0
        self._heartbeat_timeout_s: float | None = None  # the dead sweep's, for the lease sweep
        self._retained_through = -1  # payloads of steps up to this one were dropped

    @timed
    @retry_transient
    def seed(self) -> dict[str, int]:
        """Queue episodes for every active task up to its admission cap. Returns per task
        name the number of episodes added."""
        added: dict[str, int] = {}
        with self.db.transaction() as tx:
            rows = tx.episodes.lock_seedable_tasks(self.job_id)
            # Groups the step being trained holds but will not train (dynamic sampling judged
            # their rewards all equal: ``TrainerBuffer.extend_batch``) are not outstanding work:
            # the step waits for groups to replace them.
            mix = tx.batches.job_state(self.job_id).pending_mix or {}
            untrained = {
                int(k): int(v.get("degenerate", 0)) for k, v in mix.items() if isinstance(v, dict)
            }
            counts = seed_counts(
                [
                    SeedInput(
                        r.task_id,
                        r.weight,
                        r.max_staleness,
                        max(0, r.outstanding - untrained.get(r.task_id, 0)),
                    )
                    for r in rows
                ],
                self.config.batch_groups,
            )
            for r in rows:
                n = counts[r.task_id]
                if n <= 0:
                    continue
                plugin = self._plugins(r.plugin)
                spec = plugin.Spec.model_validate(r.spec)
                prompts = [
                    bounded_prompt(plugin.prompt(spec, r.prompt_cursor + i), self.prompt_bytes)
                    for i in range(n)
                ]
                tx.episodes.add_episodes(
                    job_id=self.job_id,
                    task_id=r.task_id,
                    first_index=r.prompt_cursor,
                    prompts=prompts,
                    group_size=spec.group_size,
                )
                added[r.name] = n
        return added

    # -- sweeps ---------------------------------------------------------------------------------

    @timed
    @retry_transient
    def sweep_expired_leases(self) -> SweepResult:
        """Requeue (or quarantine) every episode whose lease expired on the database clock.
        After an outage (see ``sweep_dead_workers``) no lease expires until its holders had
        ``heartbeat_timeout_s`` + the retries' backoff cap to beat (and so renew) again: a
        holder that does not is declared dead, which requeues its leases."""
        with self.db.transaction() as tx:
            ended = self._outage_seen(tx.workers.db_now())
            hold = None
            if ended is not None:
                wait_s = self._heartbeat_timeout_s or self.config.lease_s
                hold = ended + timedelta(seconds=CAP_S + wait_s)
            rows = tx.episodes.lock_expired_leases(self.job_id, held_until=hold)
            return self._requeue(tx, rows, "lease expired")

    @timed
    @retry_transient
    def sweep_dead_workers(
        self, heartbeat_timeout_s: float, progress_timeout_s: float
    ) -> list[DeadWorker]:
        """Declare dead every live worker of the job whose heartbeat (or, for a rollout node,
        whose generation progress) is older than its timeout on the database clock, and
        requeue its leases.

        After an outage nobody could beat, so nobody is judged by the beats it missed: the
        sweep takes the outage to have ended when it first goes through again after calls of
        this buffer (and those beside it) failed, or after a gap in its own runs
        longer than half the heartbeat timeout (the process stalled, or the outage met none of
        its calls), and counts the ages from that end plus the retries' backoff cap at the
        earliest. Every worker gets ``heartbeat_timeout_s`` + ``CAP_S`` after the outage to beat
        again, however late its retry's backoff lets its first beat through."""
        with self.db.transaction() as tx:
            now = tx.workers.db_now()
            self._heartbeat_timeout_s = heartbeat_timeout_s
            with self._outage_lock:
                last, self._last_dead_sweep = self._last_dead_sweep, now
            since_last = None if last is None else (now - last).total_seconds()
            gap = since_last is not None and since_last > heartbeat_timeout_s / 2
            if gap:
                log.warning(
                    "dead-worker sweep: %.1f s since the last one (the driver or the database "
                    "stalled); nobody is judged by the beats it may have missed meanwhile",
                    since_last,
                )
            ended = self._outage_seen(now, gap=gap)
            since = None if ended is None else ended + timedelta(seconds=CAP_S)
            dead = []
            for w in tx.workers.lock_overdue(
                self.job_id, heartbeat_timeout_s, progress_timeout_s, since=since
            ):
                why = f"declared dead by the control plane ({w['reason']})"
                tx.workers.set_status(w["id"], WorkerStatus.DEAD, why)
                swept = self._requeue(
                    tx,
                    tx.episodes.lock_worker_leases(w["id"]),
                    f"worker {w['name']} dead ({w['reason']})",
                )
                tx.events.add(
                    "worker.dead",
                    ACTOR,
                    f"worker {w['name']} (incarnation {w['incarnation']}) declared dead: "
                    f"{w['reason']}; {swept.requeued} leases requeued",
                    job_id=self.job_id,
                    payload={**w, "requeued": swept.requeued, "quarantined": swept.quarantined},
                )
                dead.append(DeadWorker(w["id"], w["name"], w["reason"], swept))
            return dead

    def _outage_seen(self, now: Any, *, gap: bool = False) -> Any:
        """Database time at which the sweeps last saw an outage end (None: never). An outage
        ends now when this buffer's calls failed since a sweep last looked, or on ``gap``."""
        with self._outage_lock:
            failures = self.outages.failures
            if gap or failures != self._failures_seen:
                self._failures_seen = failures
                if self._outage_end is None or now > self._outage_end:
                    self._outage_end = now
            return self._outage_end

    @timed
    @retry_transient
    def expire_stale(self) -> dict[str, int]:
        """Expire finished groups older than their task's staleness bound (their prompts are
        queued again); per task name, the groups expired. Claims do this too; the control
        plane runs it on a schedule so stale data does not hold admission slots."""
        with self.db.transaction() as tx:
            tx.batches.lock_job_batches(self.job_id)
            job = tx.batches.job_state(self.job_id)
            return self._expire(tx, job.policy_version)

    @timed
    @retry_transient
    def drop_old_payloads(self, max_steps: int = RETENTION_STEPS_PER_PASS) -> tuple[int, int]:
        """Retention (``buffer.payload_retention_steps`` / ``payload_retention_s``): drop the
        payloads (tokens, masks, log-probs) of trajectories consumed by old steps, and of
        groups that expired before them, at most ``max_steps`` steps per call; the metadata
        stays. Returns (trajectories, payload bytes) dropped."""
        keep_steps, keep_s = self.config.payload_retention_steps, self.config.payload_retention_s
        if keep_steps is None and keep_s is None:
            return 0, 0
        with self.db.transaction() as tx:
            cut = tx.trajectories.retention_step(self.job_id, keep_steps, keep_s)
            if cut <= self._retained_through:
                return 0, 0
            through = min(cut, self._retained_through + max_steps)
            dropped = tx.trajectories.drop_payloads(self.job_id, self._retained_through, through)
        self._retained_through = through
        return dropped

    @timed
    @retry_transient
    def compact_metadata(
        self, min_age_s: float = METADATA_MIN_AGE_S, max_steps: int = COMPACT_STEPS_PER_PASS
    ) -> int:
        """Metadata retention (``buffer.metadata_retention_steps``): the row-level detail of
        steps older than the window, and of groups that ended before them, compacted into
        totals (``HistoryRepository.compact``), at most ``max_steps`` steps per call. Returns
        the episodes compacted."""
        keep = self.config.metadata_retention_steps
        if keep is None:
            return 0
        with self.db.transaction() as tx:
            return tx.history.compact(self.job_id, keep, min_age_s, max_steps)

    @timed
    @retry_transient
    def drop_old_events(self, keep_s: float | None, keep_count: int | None) -> int:
        """Retention of the job's audit log (``control_plane.event_retention_s`` /
        ``event_retention_count``): delete its events older than ``keep_s`` and beyond its
        newest ``keep_count``, except those of the last hour and its newest of each kind
        (``EventRepository.drop_old``), at most 10,000 per call. Returns the events
        deleted."""
        with self.db.transaction() as tx:
            return tx.events.drop_old(self.job_id, keep_s, keep_count)

    # -- what the driver and its supervisor read and record ---------------------------------

    @timed
    @retry_transient
    def events_after(self, after_id: int, kinds: tuple[str, ...]) -> list[EventView]:
        """The job's events of ``kinds`` newer than ``after_id``, oldest first."""
        with self.db.transaction() as tx:
            return tx.events.after(self.job_id, after_id, kinds)

    @timed
    @retry_transient
    def last_event_id(self) -> int:
        with self.db.transaction() as tx:
            return tx.events.last_id()

    @timed
    @retry_transient
    def tasks(self) -> list[TaskView]:
        """The job's tasks that are not retired."""
        with self.db.transaction() as tx:
            return tx.tasks.list(self.job_id, include_retired=False)

    @timed
    @retry_transient
    def node_health(self) -> list[dict[str, Any]]:
        with self.db.transaction() as tx:
            return tx.workers.health(self.job_id)

    @timed
    @retry_transient
    def depth(self) -> dict[str, int]:
        """Episodes of the job by status (``done`` split into ``ready`` and ``consumed``)."""
        with self.db.transaction() as tx:
            return tx.episodes.depth(self.job_id)

    @timed
    @retry_transient
    def set_fleet_size(self, nodes: int) -> None:
        """A new run's fleet: ``nodes`` rollout nodes, the slots of earlier runs forgotten."""
        with self.db.transaction() as tx:
            tx.fleet.set_size(self.job_id, nodes)
            tx.fleet.forget(self.job_id)

    @timed
    @retry_transient
    def fleet_size(self) -> int | None:
        """The rollout nodes the job should have (``rollcall job scale``; None: not set)."""
        with self.db.transaction() as tx:
            return tx.fleet.size(self.job_id)

    @timed
    @retry_transient
    def record_slot(self, name: str, **state: Any) -> None:
        """A rollout slot's state as the supervisor sees it (``FleetRepository.record``)."""
        with self.db.transaction() as tx:
            tx.fleet.record(self.job_id, name, **state)
