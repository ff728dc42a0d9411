"""The trainer's buffer: what the job driver's trainer loop does to the buffer
(``TrainerBuffer``).

Batch claims (whole groups per task by weight, stale ones expired; a batch reserved for its
step until it is committed, so a restarted trainer replays it), dynamic sampling's extra claims
into a step's batch, the read-ahead of finished groups off the trainer's critical path, step
commits, and the return of an uncommitted batch's claims when the trainer died. Batch claims,
extra claims and step commits are fenced by the driver's epoch.
"""

from __future__ import annotations

import copy
import threading
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollcall.orchestrator.buffer.base import ACTOR, BufferBase
from rollcall.orchestrator.buffer.timings import timed
from rollcall.orchestrator.buffer.types import DYNAMIC_CLAIMS, Batch
from rollcall.orchestrator.config import BufferConfig
from rollcall.orchestrator.db.engine import Database, Tx
from rollcall.orchestrator.db.retry import retry_transient
from rollcall.orchestrator.domain import BatchTrajectory
from rollcall.orchestrator.errors import ConflictError, DriverFencedError
from rollcall.orchestrator.quotas import allocate_batch


@dataclass(frozen=True)
class StepCommit:
    step: int
    policy_version: int  # the version this step produced
    groups: int
    trajectories: int
    already_committed: bool


class TrainerBuffer(BufferBase):
    def __init__(
        self,
        db: Database,
        job_id: int,
        config: BufferConfig | None = None,
        *,
        driver_epoch: int | None = None,
        beside: BufferBase | None = None,
    ) -> None:
        super().__init__(db, job_id, config, beside=beside)
        # The job driver's epoch (``jobs.driver_epoch`` when it took the job): its batch claims
        # and step commits are refused once another driver took the job. None: not fenced.
        self.driver_epoch = driver_epoch
        # Samples of finished groups read ahead of their claim (``prefetch_groups``), by
        # episode id; a finished group's samples never change, only their status does.
        self._prefetched: dict[int, tuple[BatchTrajectory, ...]] = {}
        self._prefetch_lock = threading.Lock()
        # NaN rewards stored by an older rollcall were looked for (the first batch claim)
        self._nonfinite_checked = False

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

    @timed
    @retry_transient
    def extend_batch(
        self,
        step: int,
        wanted: int,
        *,
        have: Collection[int],
        degenerate: Mapping[int, int],
    ) -> Batch:
        """Dynamic sampling's extra claim: reserve ``wanted`` more finished groups into the
        batch already claimed for ``step``, split among the tasks by weight as a batch is (the
        split's carry goes on from the step's), and count the claim in the step's task mix
        (``Batch.dynamic_claims``): the reservation is the step's, so a restarted driver
        replays all of it (``claim_batch``) and the commit consumes all of it. Nothing is
        reserved unless ``wanted`` groups are available (the batch comes back empty, with its
        shortfall); ``wanted`` 0 reserves nothing.

        ``have``: the episode ids of the step's groups the caller holds; groups reserved for
        the step that it lacks (an extra claim committed whose answer was lost) come back
        instead of a new claim. ``degenerate``: per task id, how many of the step's groups the
        trainer judged without variance (rewards all equal): recorded in the task mix, as they
        are consumed without being trained, the task's admission does not count them
        (``ControlPlaneBuffer.seed``), so rollout goes on for the groups the step lacks.
        Returns the new groups only, with the step's whole task mix."""
        with self.db.transaction() as tx:
            return self._extend_batch(tx, step, wanted, set(have), degenerate)

    def _extend_batch(
        self, tx: Tx, step: int, wanted: int, have: set[int], degenerate: Mapping[int, int]
    ) -> Batch:
        tx.batches.lock_job_batches(self.job_id)
        job = tx.batches.job_state(self.job_id)
        self._check_driver(job.driver_epoch, f"reserve more groups for step {step}")
        reserved = tx.batches.reserved_groups(self.job_id, step)
        if step != job.policy_version or job.pending_step != step or not reserved:
            raise ConflictError(
                f"step {step} has no claimed batch to reserve more groups into (the job's "
                f"policy version is {job.policy_version}); claim one with claim_batch"
            )
        version = job.policy_version
        mix: dict[str, Any] = copy.deepcopy(job.pending_mix or {})
        if lacking := [e for e in reserved if e not in have]:
            ahead = self._take_prefetched(lacking)
            groups = tx.batches.load_groups(lacking, ahead)
            return Batch(step, version, tuple(groups), mix, False, {}, len(ahead))
        changed = False
        for key, entry in mix.items():
            if isinstance(entry, dict) and entry.get("degenerate", 0) != (
                n := int(degenerate.get(int(key), 0))
            ):
                entry["degenerate"] = n
                changed = True
        if wanted <= 0:
            if changed:
                tx.batches.set_pending(self.job_id, step, mix)
            return Batch(step, version, (), mix, False, {})

        tasks = tx.batches.trainable_tasks(self.job_id)
        expired_by_task = self._expire(tx, version, tasks)
        available = tx.batches.available_groups(self.job_id, version)
        carry = {int(k): float(v.get("carry", 0.0)) for k, v in mix.items() if isinstance(v, dict)}
        alloc = allocate_batch({t.id: t.weight for t in tasks}, available, carry, wanted)
        entries = {}
        for t in tasks:
            entry = entries[t.id] = mix.setdefault(str(t.id), {"name": t.name, "groups": 0})
            entry["available"] = available.get(t.id, 0)
            entry["expired"] = entry.get("expired", 0) + expired_by_task.get(t.name, 0)
        if (found := sum(alloc.groups.values())) < wanted:
            if changed or expired_by_task:
                tx.batches.set_pending(self.job_id, step, mix)
            return Batch(step, version, (), mix, False, expired_by_task, shortfall=wanted - found)
        by_id = {t.id: t for t in tasks}
        ids = tx.batches.reserve_groups(
            step,
            version,
            [(t, n, by_id[t].max_staleness) for t, n in sorted(alloc.groups.items()) if n > 0],
        )
        if not ids:  # taken by another transaction meanwhile (skipped locked): no claim
            tx.batches.set_pending(self.job_id, step, mix)
            return Batch(step, version, (), mix, False, expired_by_task, shortfall=wanted)
        ahead = self._take_prefetched(ids)
        groups = tx.batches.load_groups(ids, ahead)
        added = Counter(g.task_id for g in groups)
        for t in tasks:
            entry = entries[t.id]
            entry["groups"] = entry.get("groups", 0) + added[t.id]
            entry["extra"] = entry.get("extra", 0) + added[t.id]
            entry["carry"] = round(alloc.carry.get(t.id, 0.0), 6)
        mix[DYNAMIC_CLAIMS] = int(mix.get(DYNAMIC_CLAIMS, 0)) + 1
        tx.batches.mark_claimed(self.job_id, step)
        tx.batches.set_pending(self.job_id, step, mix)
        return Batch(step, version, tuple(groups), mix, False, expired_by_task, len(ahead))

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

    @timed
    @retry_transient
    def release_trainer_claims(self) -> int:
        """Claimed trajectories of an uncommitted step back to ``ready`` (trainer died); the
        step's reservation stays, so the restarted trainer replays the same batch."""
        with self.db.transaction() as tx:
            return tx.batches.release_claims(self.job_id)
