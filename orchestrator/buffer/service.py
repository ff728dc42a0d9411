"""The durable replay buffer: the state machine every piece of work flows through.

``Buffer`` owns the transactions; the SQL lives in ``orchestrator.db`` repositories and the
arithmetic in ``orchestrator.quotas``. What it guarantees, for one job:

- **Seeding** keeps each active task supplied with queued episodes from its plugin's prompt
  stream, up to its admission cap and never beyond; the prompt cursor advances in the same
  transaction as the inserts, so a restart neither repeats nor skips prompts.
- **Claims** go to the task with the largest deficit against its weight, under its in-flight
  cap; each claim bumps the lease epoch.
- **Checkpoints and commits** are fenced by the lease epoch: a write by a holder whose lease
  moved on raises ``StaleLeaseError``, changes nothing, and is counted on the task. A commit is
  idempotent on (episode, sample); the last sample of a group completes its episode.
- **Requeue** (lease expired, worker dead, worker gave up) returns an episode to the queue with
  its checkpoints; the next claimer receives them and continues. After ``max_attempts`` claims
  the episode is quarantined instead, with an event.
- **Batch claims** take whole groups per task by weight, within each task's staleness bound,
  oldest first; stale groups are expired and their prompts queued again. A batch is reserved
  for its step until ``commit_step`` consumes it, so a restarted trainer replays the same batch.
- **Step commits** consume the batch, record the step and bump the policy version atomically.
  With a ``driver_epoch``, batch claims and step commits are refused (``DriverFencedError``)
  once another driver has taken the job (``jobs.driver_epoch`` moved on).

Every episode ends in exactly one of: consumed by a step (``done`` + ``consumed_step``),
``expired`` (its prompt requeued as a new episode), or ``quarantined`` (after ``max_attempts``
claims, or a finished group none of whose samples generated a token).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from orchestrator.buffer.stored import StoredPrefixes
from orchestrator.buffer.timings import OpTimings, timed
from orchestrator.buffer.types import (
    Batch,
    ClaimedEpisode,
    CommitResult,
    Lease,
    SweepResult,
)
from orchestrator.config import BufferConfig
from orchestrator.db.engine import Database, Tx
from orchestrator.db.repos.batches import TaskQuotaRow, ungenerated_cause
from orchestrator.db.repos.episodes import LeasedRow
from orchestrator.db.repos.workers import WorkerView
from orchestrator.db.retry import CAP_S, Outage, OutageTracker, retry_transient
from orchestrator.domain import (
    BatchTrajectory,
    EventView,
    SampleState,
    TaskView,
    TrajectoryPayload,
    WorkerRole,
    WorkerStatus,
    paused_sentence,
)
from orchestrator.errors import ConflictError, DriverFencedError, StaleLeaseError
from orchestrator.quotas import SeedInput, allocate_batch, claim_order, seed_counts
from tasks import registry
from tasks.base import TaskPlugin

log = logging.getLogger(__name__)

ACTOR = "control-plane"
_MOVED_ON = "the lease has moved on (requeued or expired)"
# Steps whose payloads one retention pass drops at most (a job that turns retention on late
# catches up over several passes instead of one long transaction).
RETENTION_STEPS_PER_PASS = 20
# The longest an episode whose user code failed waits before it is claimable again.
MAX_RETRY_BACKOFF_S = 300.0


@dataclass(frozen=True)
class StepCommit:
    step: int
    policy_version: int  # the version this step produced
    groups: int
    trajectories: int
    already_committed: bool


@dataclass(frozen=True)
class UserFailure:
    """What became of an episode whose user code failed (``Buffer.fail_user_code``)."""

    quarantined: bool
    attempt: int
    retry_in_s: float | None
    at: Any = None  # when (database clock)


@dataclass(frozen=True)
class DeadWorker:
    worker_id: int
    name: str
    reason: str
    swept: SweepResult


class Buffer:
    def __init__(
        self,
        db: Database,
        job_id: int,
        config: BufferConfig | None = None,
        plugins: Callable[[str], TaskPlugin] = registry.get,
        *,
        driver_epoch: int | None = None,
    ) -> None:
        self.db = db
        # heartbeats' own database (a node's: its loops, waiting for their pool's connections,
        # never hold a heartbeat back); None: ``db``
        self.beat_db: Database | None = None
        self.job_id = job_id
        # The job driver's epoch (``jobs.driver_epoch`` when it took the job): its batch claims
        # and step commits are refused once another driver took the job. None: not fenced.
        self.driver_epoch = driver_epoch
        self.config = config or BufferConfig()
        self.retry_window_s = self.config.retry_window
        self.outages = OutageTracker()  # database outages as this Buffer's calls saw them
        self.record_outages = False  # each one a ``database.outage`` event (the driver's)
        self.on_outage: Callable[[Outage], None] | None = None
        self._last_dead_sweep: Any = None
        # The sweeps' view of outages (database clock): when they last saw one end.
        self._outage_lock = threading.Lock()
        self._outage_end: Any = None
        self._failures_seen = 0
        self._heartbeat_timeout_s: float | None = None  # the dead sweep's, for the lease sweep
        self._plugins = plugins
        self.timings = OpTimings()  # wall and CPU time of each operation (control-plane cost)
        # Samples of finished groups read ahead of their claim (``prefetch_groups``), by
        # episode id; a finished group's samples never change, only their status does.
        self._prefetched: dict[int, tuple[BatchTrajectory, ...]] = {}
        self._prefetch_lock = threading.Lock()
        # What this writer has stored of each sample it holds: checkpoints append new turns.
        self._stored = StoredPrefixes()
        self._retained_through = -1  # payloads of steps up to this one were dropped
        # NaN rewards stored by an older rollcall were looked for (the first batch claim)
        self._nonfinite_checked = False

    # -- control plane ------------------------------------------------------------------------

    @timed
    @retry_transient
    def seed(self) -> dict[str, int]:
        """Queue episodes for every active task up to its admission cap. Returns per task
        name the number of episodes added."""
        added: dict[str, int] = {}
        with self.db.transaction() as tx:
            rows = tx.episodes.lock_seedable_tasks(self.job_id)
            counts = seed_counts(
                [SeedInput(r.task_id, r.weight, r.max_staleness, r.outstanding) for r in rows],
                self.config.batch_groups,
            )
            for r in rows:
                n = counts[r.task_id]
                if n <= 0:
                    continue
                plugin = self._plugins(r.plugin)
                spec = plugin.Spec.model_validate(r.spec)
                prompts = [plugin.prompt(spec, r.prompt_cursor + i) for i in range(n)]
                tx.episodes.add_episodes(
                    job_id=self.job_id,
                    task_id=r.task_id,
                    first_index=r.prompt_cursor,
                    prompts=prompts,
                    group_size=spec.group_size,
                )
                added[r.name] = n
        return added

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
    def requeue_worker(
        self, worker_id: int, status: WorkerStatus = WorkerStatus.DEAD, *, counted: bool = True
    ) -> SweepResult:
        """Declare a worker dead (or stopped) and requeue every lease it held, as a counted
        attempt of each episode unless ``counted`` is False (its machine was lost, or it was
        drained: not the episodes' doing)."""
        with self.db.transaction() as tx:
            tx.workers.set_status(worker_id, status)
            rows = tx.episodes.lock_worker_leases(worker_id)
            return self._requeue(tx, rows, f"worker {worker_id} {status.value}", counted=counted)

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
        this Buffer failed, or after a gap in its own runs longer than half the heartbeat
        timeout (the process stalled, or the outage met none of its calls), and counts the
        ages from that end plus the retries' backoff cap at the earliest. Every worker gets
        ``heartbeat_timeout_s`` + ``CAP_S`` after the outage to beat again, however late its
        retry's backoff lets its first beat through."""
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
        ends now when this Buffer's calls failed since a sweep last looked, or on ``gap``."""
        with self._outage_lock:
            failures = self.outages.failures
            if gap or failures != self._failures_seen:
                self._failures_seen = failures
                if self._outage_end is None or now > self._outage_end:
                    self._outage_end = now
            return self._outage_end

    def _outage_ended(self, outage: Outage) -> None:
        """The retry layer's report, once per outage, after the first call that went through:
        logged, and with ``record_outages`` recorded as an event (one attempt; the retry layer
        reports it again after the next success if that fails)."""
        if self.record_outages:
            with self.db.transaction() as tx:
                tx.events.add(
                    "database.outage",
                    ACTOR,
                    outage.describe(),
                    job_id=self.job_id,
                    payload=outage.payload(),
                )
        log.warning("%s", outage.describe())
        if self.on_outage is not None:
            try:
                self.on_outage(outage)
            except Exception:
                log.exception("reporting the outage failed")

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
    def event(self, kind: str, message: str, payload: dict[str, Any] | None = None) -> None:
        """Record a control-plane event for operators."""
        with self.db.transaction() as tx:
            tx.events.add(kind, ACTOR, message, job_id=self.job_id, payload=payload or {})

    @timed
    @retry_transient
    def release_trainer_claims(self) -> int:
        """Claimed trajectories of an uncommitted step back to ``ready`` (trainer died); the
        step's reservation stays, so the restarted trainer replays the same batch."""
        with self.db.transaction() as tx:
            return tx.batches.release_claims(self.job_id)

    @timed
    @retry_transient
    def give_back(
        self, worker_id: int, reason: str, kind: str = "worker.engine_failed"
    ) -> SweepResult:
        """A rollout node that is broken gives up (its engine failed, or its breaker tripped:
        ``kind`` names which, as the event's kind): it is marked dead and every lease it
        holds is requeued at once, not counted as an attempt of the episode (a broken node
        is not a poison input); the next claimer resumes from the checkpoints."""
        what = "engine failed" if kind == "worker.engine_failed" else "breaker tripped"
        with self.db.transaction() as tx:
            tx.workers.set_status(worker_id, WorkerStatus.DEAD, f"{what}: {reason}")
            rows = tx.episodes.lock_worker_leases(worker_id)
            result = self._requeue(tx, rows, f"{what}: {reason}", counted=False)
            tx.events.add(
                kind,
                ACTOR,
                f"worker {worker_id}: {what} ({reason}); {result.requeued} leases "
                "given back (not counted as attempts)",
                job_id=self.job_id,
                payload={"worker_id": worker_id, "reason": reason, "requeued": result.requeued},
            )
            return result

    def _requeue(
        self, tx: Tx, rows: Sequence[Any], reason: str, *, counted: bool = True
    ) -> SweepResult:
        if counted:
            done = tx.episodes.requeue_or_quarantine(rows, self.config.max_attempts, reason)
        else:
            done = tx.episodes.requeue_uncounted(rows, reason)
        for r in done:
            if r.quarantined:
                tx.episodes.bump_task_counter(r.task_id, "quarantined_episodes")
                tx.events.add(
                    "episode.quarantined",
                    ACTOR,
                    f"episode {r.episode_id} quarantined after {self.config.max_attempts} "
                    f"attempts ({reason})",
                    job_id=self.job_id,
                    task_id=r.task_id,
                    payload={"episode_id": r.episode_id, "reason": reason},
                )
            else:
                tx.episodes.bump_task_counter(r.task_id, "requeued_leases")
        return SweepResult(
            requeued=sum(not r.quarantined for r in done),
            quarantined=sum(r.quarantined for r in done),
            episode_ids=tuple(r.episode_id for r in done),
        )

    # -- rollout side --------------------------------------------------------------------------

    @timed
    @retry_transient
    def register_worker(
        self, name: str, role: WorkerRole = WorkerRole.ROLLOUT, **info: Any
    ) -> WorkerView:
        with self.db.transaction() as tx:
            return tx.workers.register(job_id=self.job_id, role=role, name=name, **info)

    @timed
    @retry_transient
    def mark_worker_alive(self, worker_id: int, info: dict[str, Any] | None = None) -> bool:
        """A rollout node registered ``starting`` is up (its engine answers); False when it was
        declared dead meanwhile."""
        with self.db.transaction() as tx:
            return tx.workers.mark_alive(worker_id, info)

    @timed
    @retry_transient
    def heartbeat(
        self, worker_id: int, tokens_generated: int = 0, loaded_version: int | None = None
    ) -> list[tuple[int, int]]:
        """Liveness plus lease renewal. Returns the (episode, epoch) leases still held; a
        lease missing from the list has moved on and its work must be abandoned."""
        return self.beat(worker_id, tokens_generated, loaded_version)[1]

    @timed
    @retry_transient
    def beat(
        self,
        worker_id: int,
        tokens_generated: int = 0,
        loaded_version: int | None = None,
        progress: bool = False,
    ) -> tuple[bool, list[tuple[int, int]]]:
        """``heartbeat`` that also says whether the worker is still alive: False once it has
        been declared dead (it must stop; a new incarnation takes its place). ``progress``: the
        worker proved it works without generating tokens (a probe or a weight load ended)."""
        with (self.beat_db or self.db).transaction() as tx:
            if not tx.workers.heartbeat(worker_id, tokens_generated, loaded_version, progress):
                return False, []
            return True, tx.episodes.renew(worker_id, self.config.lease_s)

    @timed
    @retry_transient
    def published_weights(self) -> tuple[int, str] | None:
        """(version, location) of the latest published weights, or None before the first."""
        with self.db.transaction() as tx:
            return tx.batches.published_weights(self.job_id)

    @timed
    @retry_transient
    def node_health(self) -> list[dict[str, Any]]:
        with self.db.transaction() as tx:
            return tx.workers.health(self.job_id)

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

    @timed
    @retry_transient
    def depth(self) -> dict[str, int]:
        """Episodes of the job by status (``done`` split into ``ready`` and ``consumed``)."""
        with self.db.transaction() as tx:
            return tx.episodes.depth(self.job_id)

    @timed
    @retry_transient
    def claim(self, worker_id: int) -> ClaimedEpisode | None:
        """Lease one episode for the worker, or None when no task has claimable work. The
        claim carries the job's published weights, read after the lease was taken."""
        # Autocommit: each claim attempt is one statement and one transaction, so a task's
        # lock is held only while the database runs it. First attempt: never wait; a task whose
        # lock another claimer holds is skipped, which spreads claimers over tasks. Only when
        # every candidate was skipped, wait for them one at a time, best first.
        with self.db.autocommit() as tx:
            order = claim_order(tx.episodes.task_loads(self.job_id, self.config.claim_window_s))
            if not order:
                return None
            row, skipped = tx.episodes.claim(
                order, worker_id, self.config.lease_s, self.config.claim_window_s, wait=False
            )
            for task_id in skipped if row is None else ():
                row, _ = tx.episodes.claim(
                    [task_id], worker_id, self.config.lease_s, self.config.claim_window_s, wait=True
                )
                if row is not None:
                    break
            if row is None:
                return None
            return self._claimed(tx, row, worker_id)

    def _claimed(self, tx: Tx, row: LeasedRow, worker_id: int) -> ClaimedEpisode:
        # An episode claimed before may hold checkpoints: its lease epoch moved past the first
        # claim's (1), whether or not that claim counted as an attempt (an engine failure's
        # requeue gives the attempt back, so ``attempts`` alone would miss them).
        if row.lease_epoch > 1:
            samples = tx.trajectories.samples_for_resume(row.task_id, row.id, row.group_size)
            for sample in samples:
                if sample.checkpoint is not None:
                    self._stored.stored(
                        (row.id, row.lease_epoch, sample.sample_index), sample.checkpoint
                    )
        else:
            samples = tuple(SampleState(i, "new") for i in range(row.group_size))
        published = tx.batches.published_weights(self.job_id)
        return ClaimedEpisode(
            lease=Lease(row.id, row.task_id, row.lease_epoch, worker_id),
            task_name=row.task_name,
            plugin=row.plugin,
            spec=row.spec,
            prompt_index=row.prompt_index,
            prompt=row.prompt,
            group_size=row.group_size,
            attempts=row.attempts,
            samples=samples,
            published_weights=published,
        )

    @timed
    @retry_transient
    def checkpoint(self, lease: Lease, sample_index: int, payload: TrajectoryPayload) -> None:
        """Record a trajectory's progress after a turn. Fenced by the lease epoch."""
        self._write_one(lease, sample_index, payload, None, None)

    @timed
    @retry_transient
    def commit(
        self,
        lease: Lease,
        sample_index: int,
        payload: TrajectoryPayload,
        reward: float,
        reward_info: dict[str, Any] | None = None,
    ) -> CommitResult:
        """Commit a finished trajectory as ``ready`` with its reward (idempotent, fenced). A
        reward that is not a finite number is refused (``ValueError``): the rollout side checks
        rewards where they are produced, as the input's fault, so this never happens."""
        _check_finite(lease, sample_index, reward)
        return self._write_one(lease, sample_index, payload, reward, reward_info)

    @timed
    @retry_transient
    def commit_many(
        self,
        lease: Lease,
        samples: Sequence[tuple[int, TrajectoryPayload, float, dict[str, Any] | None]],
    ) -> CommitResult:
        """Commit several finished samples of one group in one transaction."""
        for s in samples:
            _check_finite(lease, s[0], s[2])
        return self._commit_group(lease, list(samples))

    @timed
    @retry_transient
    def release(self, lease: Lease, error: str, *, counted: bool = True) -> SweepResult:
        """The worker gives the episode up: requeue or quarantine (its rollout failed), or,
        with ``counted=False`` (its engine failed, not the episode), requeue without counting
        the attempt."""
        self._stored.forget_episode(lease.episode_id)
        with self.db.transaction() as tx:
            row = tx.episodes.lock_lease(lease.episode_id, lease.epoch)
            if row is None:
                raise StaleLeaseError(lease.episode_id, lease.epoch, "lease is no longer held")
            return self._requeue(tx, [row], f"released by worker: {error}", counted=counted)

    @timed
    @retry_transient
    def fail_user_code(
        self, lease: Lease, failure: dict[str, Any], *, backoff_s: float
    ) -> UserFailure:
        """User code failed on the episode's input (``workers.rollout.usercode``): the lease is
        released as a counted attempt, and the episode is either quarantined (its attempts are
        spent) or queued again after a backoff (``backoff_s * 2^(attempts-1)``, at most
        ``MAX_RETRY_BACKOFF_S``), and twice that for the worker it failed on, so another node
        tries it first. One ``episode.user_error`` event names the task, the prompt, the error,
        where in the user's code it happened and its traceback (``failure``: the error's
        payload, with ``task``, ``prompt_index``, ``sample`` and ``worker``)."""
        self._stored.forget_episode(lease.episode_id)
        with self.db.transaction() as tx:
            row = tx.episodes.lock_lease(lease.episode_id, lease.epoch)
            if row is None:
                raise StaleLeaseError(lease.episode_id, lease.epoch, "lease is no longer held")
            delay = min(MAX_RETRY_BACKOFF_S, backoff_s * 2 ** max(0, row.attempts - 1))
            error = str(failure.get("error", ""))
            where = failure.get("location")
            reason = f"user code: {error}" + (f" ({where})" if where else "")
            swept = self._requeue(tx, [row], reason)
            quarantined = bool(swept.quarantined)
            if not quarantined:
                tx.episodes.set_retry(
                    lease.episode_id, delay_s=delay, worker_id=lease.worker_id,
                    worker_delay_s=2 * delay,
                )  # fmt: skip
            at = tx.workers.db_now()
            attempt = f"attempt {row.attempts} of {self.config.max_attempts}"
            then = "quarantined" if quarantined else f"retried in {delay:.3g} s"
            tx.events.add(
                "episode.user_error",
                ACTOR,
                f"task {failure.get('task')}, episode {lease.episode_id} (prompt "
                f"{failure.get('prompt_index')}): {error}"
                + (f" at {where}" if where else "")
                + f"; {attempt}, {then}",
                job_id=self.job_id,
                task_id=lease.task_id,
                worker_id=lease.worker_id,
                payload={
                    **failure,
                    "episode_id": lease.episode_id,
                    "attempt": row.attempts,
                    "max_attempts": self.config.max_attempts,
                    "quarantined": quarantined,
                    "retry_in_s": None if quarantined else delay,
                },
            )
            return UserFailure(quarantined, row.attempts, None if quarantined else delay, at)

    @timed
    @retry_transient
    def pause_task(
        self,
        task_id: int,
        reason: str,
        actor: str,
        payload: dict[str, Any],
        *,
        failures_since: Any = None,
    ) -> str:
        """Pause an active or draining task (the user-code guard: its code fails on most
        inputs), ``reason`` kept on the task (``rollcall status``, ``task show``), with a
        ``task.paused`` event whose message says how to go on. Returns ``paused``;
        ``not_active`` when the task was neither active nor draining; ``resumed`` when an
        operator resumed it after ``failures_since`` (the failures the guard counted are from
        before the fix): nothing changed in those two cases."""
        with self.db.transaction() as tx:
            if failures_since is not None:
                resumed = tx.events.last_at(task_id, "task.resumed")
                if resumed is not None and resumed >= failures_since:
                    return "resumed"
            before = tx.tasks.pause_with_reason(task_id, reason)
            if before is None:
                return "not_active"
            task = tx.tasks.get(task_id)
            assert task is not None
            tx.events.add(
                "task.paused",
                actor,
                paused_sentence(task.name, task.job_name, reason),
                job_id=self.job_id,
                task_id=task_id,
                payload={"from": before, "to": "paused", "reason": reason, **payload},
            )
            return "paused"

    def _write_one(
        self,
        lease: Lease,
        sample_index: int,
        payload: TrajectoryPayload,
        reward: float | None,
        reward_info: dict[str, Any] | None,
    ) -> CommitResult:
        """One sample, one statement, in autocommit (the per-turn hot path): the tokens this
        writer has not stored yet (``StoredPrefixes``)."""
        key = (lease.episode_id, lease.epoch, sample_index)
        start = self._stored.start(key, payload)
        with self.db.autocommit() as tx:

            def write(start: int) -> tuple[str, bool]:
                return tx.trajectories.write_sample(
                    episode_id=lease.episode_id,
                    epoch=lease.epoch,
                    sample_index=sample_index,
                    payload=payload,
                    reward=reward,
                    reward_info=reward_info,
                    start=start,
                )

            outcome, done = write(start)
            if outcome == "rebase":
                outcome, done = write(0)
            if outcome == "stale":
                tx.episodes.bump_task_counter(lease.task_id, "fenced_rejections")
            elif done:
                tx.batches.notify_group_done(self.job_id)
        self._note_written(key, payload, outcome, reward is not None)
        if outcome == "stale":
            raise StaleLeaseError(lease.episode_id, lease.epoch, _MOVED_ON)
        written = (sample_index,) if outcome == "written" and reward is not None else ()
        already = (sample_index,) if outcome == "already" else ()
        return CommitResult(committed=written, already=already, group_done=done)

    def _note_written(
        self, key: tuple[int, int, int], payload: TrajectoryPayload, outcome: str, commit: bool
    ) -> None:
        if outcome == "stale":
            self._stored.forget_episode(key[0])
        elif outcome == "written" and not commit:
            self._stored.stored(key, payload)
        else:  # committed: never written again
            self._stored.forget(key)

    def _commit_group(
        self,
        lease: Lease,
        samples: list[tuple[int, TrajectoryPayload, float | None, dict[str, Any] | None]],
    ) -> CommitResult:
        """Several samples of one group in one transaction: ``_write_one``'s statement for
        each, pipelined."""
        keys = [(lease.episode_id, lease.epoch, s[0]) for s in samples]
        starts = [self._stored.start(k, s[1]) for k, s in zip(keys, samples, strict=True)]
        with self.db.transaction() as tx:
            outcomes = tx.trajectories.write_samples(
                episode_id=lease.episode_id,
                epoch=lease.epoch,
                samples=[(*s, start) for s, start in zip(samples, starts, strict=True)],
            )
            rebase = [i for i, (outcome, _) in enumerate(outcomes) if outcome == "rebase"]
            if rebase:
                again = tx.trajectories.write_samples(
                    episode_id=lease.episode_id,
                    epoch=lease.epoch,
                    samples=[(*samples[i], 0) for i in rebase],
                )
                for i, result in zip(rebase, again, strict=True):
                    outcomes[i] = result
            stale = any(outcome == "stale" for outcome, _ in outcomes)
            done = any(d for _, d in outcomes)
            if not stale and done:
                tx.batches.notify_group_done(self.job_id)
        for key, s, (outcome, _) in zip(keys, samples, outcomes, strict=True):
            self._note_written(key, s[1], "stale" if stale else outcome, s[2] is not None)
        if stale:
            # Nothing was written; count the rejection in a transaction of its own.
            with self.db.transaction() as tx:
                tx.episodes.bump_task_counter(lease.task_id, "fenced_rejections")
            raise StaleLeaseError(lease.episode_id, lease.epoch, _MOVED_ON)
        return CommitResult(
            committed=tuple(
                s[0]
                for s, (outcome, _) in zip(samples, outcomes, strict=True)
                if outcome == "written" and s[2] is not None
            ),
            already=tuple(
                s[0]
                for s, (outcome, _) in zip(samples, outcomes, strict=True)
                if outcome == "already"
            ),
            group_done=done,
        )

    # -- retention ------------------------------------------------------------------------------

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

    # -- trainer side ---------------------------------------------------------------------------

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

    def _expire(
        self, tx: Tx, policy_version: int, tasks: Sequence[TaskQuotaRow] | None = None
    ) -> dict[str, int]:
        if tasks is None:
            tasks = tx.batches.trainable_tasks(self.job_id)
        names = {t.id: t.name for t in tasks}
        expired = Counter(
            e.task_id for e in tx.batches.expire_stale_groups(self.job_id, policy_version)
        )
        for task_id, n in sorted(expired.items()):
            tx.episodes.bump_task_counter(task_id, "expired_groups", n)
        self._quarantine_ungenerated(tx)
        return {names.get(t, str(t)): n for t, n in expired.items()}

    def _quarantine_ungenerated(self, tx: Tx) -> None:
        """Finished groups without a generated token (their prompt alone reaches
        ``rollout.max_tokens``) have no policy version: they could never be trained nor
        expire, and would hold their task's admission slots forever. They end quarantined
        (its prompt is not queued again: it would end the same way)."""
        for r in tx.batches.quarantine_ungenerated_groups(self.job_id):
            tx.episodes.bump_task_counter(r.task_id, "quarantined_episodes")
            tx.events.add(
                "episode.quarantined",
                ACTOR,
                f"episode {r.id} quarantined: none of its samples generated a token "
                f"({ungenerated_cause(r)}); raise rollout.max_tokens or shorten the task's "
                "prompts",
                job_id=self.job_id,
                task_id=r.task_id,
                payload={
                    "episode_id": r.id,
                    "reason": "no generated token",
                    "prompt_tokens": r.prompt_tokens,
                    "stop_reason": r.stop_reason,
                },
            )

    def _quarantine_nonfinite(self, tx: Tx, step: int) -> None:
        """Finished groups with a NaN or infinite reward (stored before rewards were checked
        where they are produced) are quarantined, never trained, each with an event; when one
        of them was reserved by ``step``, the step's reservation is released (it claims a new
        batch)."""
        released = False
        for r in tx.batches.quarantine_nonfinite_groups(self.job_id):
            tx.episodes.bump_task_counter(r.task_id, "quarantined_episodes")
            values = ", ".join(str(v) for v in r.rewards)
            tx.events.add(
                "episode.quarantined",
                ACTOR,
                f"episode {r.id} (prompt {r.prompt_index}) quarantined: its rewards [{values}] "
                "are not all finite numbers; it is never trained",
                job_id=self.job_id,
                task_id=r.task_id,
                payload={
                    "episode_id": r.id,
                    "reason": "non-finite reward",
                    "prompt_index": r.prompt_index,
                    "rewards": [str(v) for v in r.rewards],
                },
            )
            released = released or r.claimed_step == step
        if released:
            tx.batches.release_reservation(self.job_id, step)

    @timed
    @retry_transient
    def claim_batch(self, step: int, min_groups: int = 0) -> Batch:
        """Claim the batch for ``step`` (or replay the one already reserved for it). With
        ``min_groups``, nothing is reserved unless at least that many groups are available
        (the batch comes back empty): the trainer waits for a full batch."""
        with self.db.transaction() as tx:
            batch = self._claim_batch(tx, step, min_groups)
        self._nonfinite_checked = True  # committed
        return batch

    def _claim_batch(self, tx: Tx, step: int, min_groups: int) -> Batch:
        """``claim_batch`` inside its transaction."""
        tx.batches.lock_job_batches(self.job_id)
        job = tx.batches.job_state(self.job_id)
        self._check_driver(job.driver_epoch, f"claim the batch of step {step}")
        if step != job.policy_version:
            raise ConflictError(
                f"step {step} cannot be claimed: the job's policy version is "
                f"{job.policy_version}, so the next step is {job.policy_version}"
            )
        if not self._nonfinite_checked:  # once per driver: only an older rollcall wrote them
            self._quarantine_nonfinite(tx, step)
        reserved = tx.batches.reserved_groups(self.job_id, step)
        if reserved:
            tx.batches.mark_claimed(self.job_id, step)
            ahead = self._take_prefetched(reserved)
            groups = tx.batches.load_groups(reserved, ahead)
            mix = job.pending_mix if job.pending_step == step and job.pending_mix else {}
            return Batch(step, job.policy_version, tuple(groups), mix, True, {}, len(ahead))

        tasks = tx.batches.trainable_tasks(self.job_id)
        expired_by_task = self._expire(tx, job.policy_version, tasks)
        expired = {t.id: expired_by_task.get(t.name, 0) for t in tasks}

        available = tx.batches.available_groups(self.job_id, job.policy_version)
        last = tx.batches.last_step(self.job_id)
        carry = {
            int(k): float(v.get("carry", 0.0))
            for k, v in (last.task_mix if last else {}).items()
            if isinstance(v, dict)
        }
        alloc = allocate_batch(
            {t.id: t.weight for t in tasks}, available, carry, self.config.batch_groups
        )
        if (found := sum(alloc.groups.values())) < min_groups:
            return Batch(
                step, job.policy_version, (), {}, False, expired_by_task,
                shortfall=min_groups - found,
            )  # fmt: skip
        by_id = {t.id: t for t in tasks}
        ids = tx.batches.reserve_groups(
            step,
            job.policy_version,
            [(t, n, by_id[t].max_staleness) for t, n in sorted(alloc.groups.items()) if n > 0],
        )
        mix = {
            str(t.id): {
                "name": t.name,
                "groups": alloc.groups.get(t.id, 0),
                "target": round(alloc.targets.get(t.id, 0.0), 6),
                "carry": round(alloc.carry.get(t.id, 0.0), 6),
                "shortfall": round(alloc.shortfall.get(t.id, 0.0), 6),
                "available": available.get(t.id, 0),
                "expired": expired.get(t.id, 0),
            }
            for t in tasks
        }
        if ids:
            tx.batches.mark_claimed(self.job_id, step)
            tx.batches.set_pending(self.job_id, step, mix)
        ahead = self._take_prefetched(ids)
        groups = tx.batches.load_groups(ids, ahead)
        return Batch(
            step, job.policy_version, tuple(groups), mix, False, expired_by_task, len(ahead)
        )

    def _check_driver(self, current: int, action: str) -> None:
        if self.driver_epoch is not None and current != self.driver_epoch:
            raise DriverFencedError(
                f"this driver (epoch {self.driver_epoch}) cannot {action}: another driver "
                f"(epoch {current}) has taken the job over, so this one stops without "
                "writing; see `rollcall job show` for the driver that runs it"
            )

    @timed
    @retry_transient
    def prefetch_groups(self, limit: int) -> int:
        """Read the samples of up to ``limit`` finished, unreserved groups (the oldest first)
        ahead of the claim that will take them, so that ``claim_batch`` does not read them on
        the trainer's critical path. Forgets groups that left the pool (claimed, expired).
        Returns the number of groups read now."""
        with self.db.transaction() as tx:
            ready = tx.batches.ready_groups(self.job_id, limit)
            with self._prefetch_lock:
                keep = {e for e, _ in ready}
                for e in [e for e in self._prefetched if e not in keep]:
                    del self._prefetched[e]
                missing = [(e, t) for e, t in ready if e not in self._prefetched]
            loaded = tx.batches.load_trajectories(missing)
        with self._prefetch_lock:
            self._prefetched.update(loaded)
        return len(loaded)

    def _take_prefetched(
        self, episode_ids: Sequence[int]
    ) -> dict[int, tuple[BatchTrajectory, ...]]:
        with self._prefetch_lock:
            return {e: self._prefetched.pop(e) for e in episode_ids if e in self._prefetched}

    @timed
    @retry_transient
    def commit_step(
        self,
        step: int,
        *,
        checkpoint_uri: str | None = None,
        metrics: dict[str, Any] | None = None,
        weights_uri: str | None = None,
    ) -> StepCommit:
        """Atomically consume the step's batch, record the step, bump the policy version and,
        with ``weights_uri``, publish the new version's weights to the rollout nodes."""
        with self.db.transaction() as tx:
            job = tx.batches.job_state(self.job_id, for_update=True)
            self._check_driver(job.driver_epoch, f"commit step {step}")
            existing = tx.batches.get_step(self.job_id, step)
            if existing is not None:
                return StepCommit(step, existing.policy_version, 0, 0, already_committed=True)
            if step != job.policy_version:
                raise ConflictError(
                    f"step {step} cannot be committed: the job's policy version is "
                    f"{job.policy_version}"
                )
            groups, trajectories = tx.batches.consume_step(self.job_id, step)
            if groups == 0:
                raise ConflictError(
                    f"step {step} has no claimed batch to commit; claim one with claim_batch"
                )
            mix = job.pending_mix if job.pending_step == step and job.pending_mix else {}
            version = job.policy_version + 1
            tx.batches.insert_step(
                job_id=self.job_id,
                step=step,
                policy_version=version,
                task_mix=mix,
                num_trajectories=trajectories,
                checkpoint_uri=checkpoint_uri,
                metrics=metrics or {},
            )
            tx.batches.advance_version(self.job_id, version)
            if weights_uri is not None:
                tx.batches.publish_weights(self.job_id, version, weights_uri)
            return StepCommit(step, version, groups, trajectories, already_committed=False)


def _check_finite(lease: Lease, sample_index: int, reward: float) -> None:
    if not math.isfinite(reward):
        raise ValueError(
            f"episode {lease.episode_id}, sample {sample_index}: reward {reward} is not a finite "
            "number and cannot be trained on"
        )
