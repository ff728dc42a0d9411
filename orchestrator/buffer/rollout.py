"""A worker's buffer: what rollout nodes (and trainer ranks, for their worker rows) do to the
buffer (``RolloutBuffer``).

Registration and heartbeats (liveness plus lease renewal), episode claims (resuming from the
checkpoints an earlier holder left), per-turn checkpoints and commits fenced by the lease
epoch, and giving work up: a release, a give-back after an engine failure, a failure of the
user's code with its backoff, the pause of a task whose code keeps failing.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from rollcall.orchestrator.buffer.base import ACTOR, BufferBase
from rollcall.orchestrator.buffer.groupcommit import GroupCommit, Pending
from rollcall.orchestrator.buffer.stored import StoredPrefixes
from rollcall.orchestrator.buffer.timings import timed
from rollcall.orchestrator.buffer.types import ClaimedEpisode, CommitResult, Lease, SweepResult
from rollcall.orchestrator.config import BufferConfig
from rollcall.orchestrator.db.engine import Database, Tx
from rollcall.orchestrator.db.repos.episodes import LeasedRow
from rollcall.orchestrator.db.repos.trajectories import SampleWrite
from rollcall.orchestrator.db.repos.workers import WorkerView
from rollcall.orchestrator.db.retry import is_transient, retry_transient
from rollcall.orchestrator.domain import (
    SampleState,
    TrajectoryPayload,
    WorkerRole,
    WorkerStatus,
    paused_sentence,
)
from rollcall.orchestrator.errors import StaleLeaseError
from rollcall.orchestrator.quotas import claim_order

_MOVED_ON = "the lease has moved on (requeued or expired)"
# The longest an episode whose user code failed waits before it is claimable again.
MAX_RETRY_BACKOFF_S = 300.0


@dataclass(frozen=True)
class UserFailure:
    """What became of an episode whose user code failed (``RolloutBuffer.fail_user_code``)."""

    quarantined: bool
    attempt: int
    retry_in_s: float | None
    at: Any = None  # when (database clock)


class RolloutBuffer(BufferBase):
    def __init__(
        self,
        db: Database,
        job_id: int,
        config: BufferConfig | None = None,
        *,
        beside: BufferBase | None = None,
    ) -> None:
        super().__init__(db, job_id, config, beside=beside)
        # heartbeats' own database (a node's: its loops, waiting for their pool's connections,
        # never hold a heartbeat back); None: ``db``
        self.beat_db: Database | None = None
        # What this writer has stored of each sample it holds: checkpoints append new turns.
        self._stored = StoredPrefixes()
        # Checkpoints and commits of the node's loops, one transaction per batch.
        self.group_commit = GroupCommit(self._write_batch)

    # -- the worker's row -----------------------------------------------------------------------

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
    def beat(
        self,
        worker_id: int,
        tokens_generated: int = 0,
        loaded_version: int | None = None,
        progress: bool = False,
    ) -> tuple[bool, list[tuple[int, int]]]:
        """Liveness plus lease renewal. Returns whether the worker is still alive (False once
        it has been declared dead: it must stop; a new incarnation takes its place) and the
        (episode, epoch) leases it still holds; a lease missing from the list has moved on and
        its work must be abandoned. ``progress``: the worker proved it works without generating
        tokens (a probe or a weight load ended)."""
        with (self.beat_db or self.db).transaction() as tx:
            if not tx.workers.heartbeat(worker_id, tokens_generated, loaded_version, progress):
                return False, []
            return True, tx.episodes.renew(worker_id, self.config.lease_s)

    # -- episodes -------------------------------------------------------------------------------

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
        """User code failed on the episode's input (``rollcall.workers.episode.usercode``): the
        lease is
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

    def _write_one(
        self,
        lease: Lease,
        sample_index: int,
        payload: TrajectoryPayload,
        reward: float | None,
        reward_info: dict[str, Any] | None,
    ) -> CommitResult:
        """One sample's write, the tokens this writer has not stored yet (``StoredPrefixes``),
        in the node's next group commit (``groupcommit.py``): it returns once the write's
        transaction committed."""
        key = (lease.episode_id, lease.epoch, sample_index)
        start = self._stored.start(key, payload)
        write = _Write(lease, SampleWrite(*key, payload, reward, reward_info, start))
        outcome, done = self.group_commit.submit(write)
        self._note_written(key, payload, outcome, reward is not None)
        if outcome == "stale":
            raise StaleLeaseError(lease.episode_id, lease.epoch, _MOVED_ON)
        written = (sample_index,) if outcome == "written" and reward is not None else ()
        already = (sample_index,) if outcome == "already" else ()
        return CommitResult(committed=written, already=already, group_done=done)

    def _write_batch(self, batch: list[Pending]) -> None:
        """Group commit: the batch's writes in one transaction, in episode order (see
        ``TrajectoryRepository.write_batch``). A write whose stored tokens do not end where it
        starts (``rebase``) is made again from token 0 in the same transaction. When the
        transaction fails for a reason other than the database's reach, each write is made
        again in a transaction of its own, so only the write at fault sees the error."""
        order = sorted(batch, key=lambda p: (p.item.write.episode_id, p.item.write.sample_index))
        try:
            out = self._write_in_one(order)
        except Exception as e:
            if len(order) == 1 or is_transient(e):
                raise
            for p in order:
                try:
                    p.settle(self._write_in_one([p])[0])
                except Exception as one:
                    p.settle(error=one)
            return
        for p, result in zip(order, out, strict=True):
            p.settle(result)

    def _write_in_one(self, order: list[Pending]) -> list[tuple[str, bool]]:
        """The writes in one transaction: a write alone is one statement in autocommit (no
        BEGIN and COMMIT round trips); several, one transaction."""
        writes = [p.item.write for p in order]
        session = self.db.autocommit() if len(writes) == 1 else self.db.transaction()
        with session as tx:
            out = tx.trajectories.write_batch(writes)
            again = [i for i, (outcome, _) in enumerate(out) if outcome == "rebase"]
            if again:
                redone = tx.trajectories.write_batch([writes[i]._replace(start=0) for i in again])
                for i, result in zip(again, redone, strict=True):
                    out[i] = result
            fenced = Counter(
                p.item.lease.task_id
                for p, (outcome, _) in zip(order, out, strict=True)
                if outcome == "stale"
            )
            for task_id, n in sorted(fenced.items()):
                tx.episodes.bump_task_counter(task_id, "fenced_rejections", n)
            if any(done for _, done in out):
                tx.batches.notify_group_done(self.job_id)
        return out

    def _note_written(
        self, key: tuple[int, int, int], payload: TrajectoryPayload, outcome: str, commit: bool
    ) -> None:
        if outcome == "stale":
            self._stored.forget_episode(key[0])
        elif outcome == "written" and not commit:
            self._stored.stored(key, payload)
        else:  # committed: never written again
            self._stored.forget(key)


@dataclass(frozen=True)
class _Write:
    """A write handed to the group commit: the sample's write and the lease it is under."""

    lease: Lease
    write: SampleWrite


def _check_finite(lease: Lease, sample_index: int, reward: float) -> None:
    if not math.isfinite(reward):
        raise ValueError(
            f"episode {lease.episode_id}, sample {sample_index}: reward {reward} is not a finite "
            "number and cannot be trained on"
        )
