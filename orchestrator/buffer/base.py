"""The durable replay buffer: the state machine every piece of work flows through.

The buffer is split by caller, each part over this shared base (the database, the job, the
buffer config, the retries of transient errors and the helpers more than one caller needs):

- ``RolloutBuffer`` (``rollout.py``): a worker's calls, a rollout node's or a trainer rank's
  (register, beat, claim, checkpoint, commit, release, give back, user-code failures);
- ``TrainerBuffer`` (``trainer.py``): the driver's trainer loop (batch claims, read-ahead of
  finished groups, step commits), fenced by the driver epoch;
- ``ControlPlaneBuffer`` (``control.py``): the driver's scheduler jobs and supervisor (seeding,
  the sweeps of expired leases and dead workers, staleness expiry, payload retention, the
  fleet, events).

The buffer owns the transactions; the SQL lives in ``rollcall.orchestrator.db`` repositories
and the arithmetic in ``rollcall.orchestrator.quotas``. What it guarantees, for one job:

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
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from rollcall.orchestrator.buffer.timings import OpTimings, timed
from rollcall.orchestrator.buffer.types import SweepResult
from rollcall.orchestrator.config import BufferConfig
from rollcall.orchestrator.db.engine import Database, Tx
from rollcall.orchestrator.db.repos.batches import TaskQuotaRow, ungenerated_cause
from rollcall.orchestrator.db.retry import Outage, OutageTracker, retry_transient
from rollcall.orchestrator.domain import WorkerStatus

log = logging.getLogger(__name__)

ACTOR = "control-plane"


class BufferBase:
    """What every caller's buffer shares: the job it works on, its config, its view of
    database outages and the cost of its operations, and the helpers of more than one caller.

    ``beside``: another buffer of the same process (the driver's trainer buffer beside its
    control plane's) whose view of database outages, their reports and the operations' cost
    this one shares: one database, its outages seen and reported once, the cost as one."""

    def __init__(
        self,
        db: Database,
        job_id: int,
        config: BufferConfig | None = None,
        *,
        beside: BufferBase | None = None,
    ) -> None:
        self.db = db
        self.job_id = job_id
        self.config = config or BufferConfig()
        self.retry_window_s = self.config.retry_window
        self._beside = beside
        # database outages as this buffer's calls saw them
        self.outages: OutageTracker = beside.outages if beside is not None else OutageTracker()
        self.record_outages = False  # each one a ``database.outage`` event (the driver's)
        self.on_outage: Callable[[Outage], None] | None = None
        # wall and CPU time of each operation (control-plane cost)
        self.timings: OpTimings = beside.timings if beside is not None else OpTimings()

    def _outage_ended(self, outage: Outage) -> None:
        """The retry layer's report, once per outage, after the first call that went through:
        logged, and with ``record_outages`` recorded as an event (one attempt; the retry layer
        reports it again after the next success if that fails). A buffer ``beside`` another
        reports through it."""
        if self._beside is not None:
            self._beside._outage_ended(outage)
            return
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
    def event(self, kind: str, message: str, payload: dict[str, Any] | None = None) -> None:
        """Record a control-plane event for operators."""
        with self.db.transaction() as tx:
            tx.events.add(kind, ACTOR, message, job_id=self.job_id, payload=payload or {})

    @timed
    @retry_transient
    def published_weights(self) -> tuple[int, str] | None:
        """(version, location) of the latest published weights, or None before the first."""
        with self.db.transaction() as tx:
            return tx.batches.published_weights(self.job_id)

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

    def _expire(
        self, tx: Tx, policy_version: int, tasks: Sequence[TaskQuotaRow] | None = None
    ) -> dict[str, int]:
        """Expire finished groups older than their task's staleness bound (their prompts are
        queued again), inside the caller's transaction; per task name, the groups expired."""
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
