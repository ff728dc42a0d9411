"""The trainer's side of the buffer: batch claims, staleness expiry, atomic step commits.

Guarantees (with ``rollcall.orchestrator.buffer``):

- Batch claims of one job are serialised by a transaction-scoped advisory lock.
- A group is claimed whole, only if its oldest sample's policy version is within its task's
  bound (``min_policy_version >= policy_version - max_staleness``); claimed groups are reserved
  for the step (``episodes.claimed_step``), so a trainer that died before committing gets the
  very same batch again for the same step.
- Groups that fell out of the bound are ``expired`` (an end state, counted per task) and their
  prompts are queued again as fresh episodes (``requeued_from``).
- Groups with no policy version (no sample generated a token) are ``quarantined``.
- A step commit consumes the step's reserved groups, writes the ``train_steps`` row and bumps
  the job's ``policy_version`` in one transaction; committing a step twice changes nothing.
  A driver's claims and commits are fenced by its driver epoch (``jobs.driver_epoch``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session
from sqlalchemy.sql.expression import bindparam

from rollcall.orchestrator.db.models import Trajectory
from rollcall.orchestrator.db.notify import groups_channel
from rollcall.orchestrator.db.repos.trajectories import TrajectoryRepository
from rollcall.orchestrator.domain import BatchGroup, BatchTrajectory

_BATCH_LOCK_NS = 0x524F4C4C  # "ROLL": namespace of the advisory lock per job


@dataclass(frozen=True)
class JobState:
    id: int
    policy_version: int
    pending_step: int | None
    pending_mix: dict[str, Any] | None
    driver_epoch: int = 0


@dataclass(frozen=True)
class TaskQuotaRow:
    id: int
    name: str
    weight: float
    max_staleness: int
    status: str


@dataclass(frozen=True)
class StepRow:
    step: int
    policy_version: int
    num_trajectories: int
    task_mix: dict[str, Any]
    checkpoint_uri: str | None
    metrics: dict[str, Any]


class BatchRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def lock_job_batches(self, job_id: int) -> None:
        self.session.execute(
            text("SELECT pg_advisory_xact_lock(:ns, :job)"), {"ns": _BATCH_LOCK_NS, "job": job_id}
        )

    def job_state(self, job_id: int, *, for_update: bool = False) -> JobState:
        row = self.session.execute(
            text(
                "SELECT id, policy_version, pending_step, pending_mix, driver_epoch FROM jobs "
                "WHERE id = :j" + (" FOR UPDATE" if for_update else "")
            ),
            {"j": job_id},
        ).one()
        return JobState(
            row.id, row.policy_version, row.pending_step, row.pending_mix, int(row.driver_epoch)
        )

    def trainable_tasks(self, job_id: int) -> list[TaskQuotaRow]:
        rows = self.session.execute(
            text(
                "SELECT id, name, weight, max_staleness, status::text AS status FROM tasks "
                "WHERE job_id = :j AND status <> 'retired' ORDER BY id"
            ),
            {"j": job_id},
        ).all()
        return [TaskQuotaRow(r.id, r.name, r.weight, r.max_staleness, r.status) for r in rows]

    def last_step(self, job_id: int) -> StepRow | None:
        row = self.session.execute(
            text(
                "SELECT step, policy_version, num_trajectories, task_mix, checkpoint_uri, metrics "
                "FROM train_steps WHERE job_id = :j ORDER BY step DESC LIMIT 1"
            ),
            {"j": job_id},
        ).one_or_none()
        return _step(row) if row else None

    def get_step(self, job_id: int, step: int) -> StepRow | None:
        row = self.session.execute(
            text(
                "SELECT step, policy_version, num_trajectories, task_mix, checkpoint_uri, metrics "
                "FROM train_steps WHERE job_id = :j AND step = :s"
            ),
            {"j": job_id, "s": step},
        ).one_or_none()
        return _step(row) if row else None

    def notify_group_done(self, job_id: int) -> None:
        """Wake the job's trainer loop if it waits for a full batch
        (``rollcall.orchestrator.db.notify``;
        delivered when this transaction commits)."""
        self.session.execute(text("SELECT pg_notify(:c, '')"), {"c": groups_channel(job_id)})

    # -- expiry ------------------------------------------------------------------------------

    def expire_stale_groups(self, job_id: int, policy_version: int) -> list[Any]:
        """Expire finished, unreserved groups older than their task's bound; queue their
        prompts again. Returns the expired episodes (id, task_id)."""
        stale = self.session.execute(
            text(
                """
                SELECT e.id, e.task_id, e.prompt_index, e.prompt, e.group_size FROM episodes e
                JOIN tasks t ON t.id = e.task_id
                WHERE e.job_id = :j AND e.status = 'done' AND e.consumed_step IS NULL
                  AND e.claimed_step IS NULL
                  AND e.min_policy_version < :v - t.max_staleness
                ORDER BY e.id
                FOR UPDATE OF e SKIP LOCKED
                """
            ),
            {"j": job_id, "v": policy_version},
        ).all()
        if not stale:
            return []
        ids = [r.id for r in stale]
        self.session.execute(
            text("UPDATE episodes SET status = 'expired', updated_at = now() WHERE id = ANY(:ids)"),
            {"ids": ids},
        )
        self.session.execute(
            text(
                "UPDATE trajectories SET status = 'expired', updated_at = now() "
                "WHERE task_id = ANY(:tids) AND episode_id = ANY(:ids) AND status = 'ready'"
            ),
            {"tids": sorted({r.task_id for r in stale}), "ids": ids},
        )
        self.session.execute(
            text(
                "INSERT INTO episodes (job_id, task_id, prompt_index, prompt, group_size, "
                "requeued_from) SELECT job_id, task_id, prompt_index, prompt, group_size, id "
                "FROM episodes WHERE id = ANY(:ids)"
            ),
            {"ids": ids},
        )
        return list(stale)

    def quarantine_ungenerated_groups(self, job_id: int) -> list[Any]:
        """Quarantine finished, unreserved groups that have no policy version: none of their
        samples generated a token (a prompt that alone reaches ``rollout.max_tokens`` ends
        with zero turns), so they can neither be trained nor fall out of a staleness bound.
        Their samples are expired. Returns the episodes (id, task_id, prompt_tokens)."""
        stuck = self.session.execute(
            text(
                """
                SELECT e.id, e.task_id, (
                    SELECT max(tr.prompt_tokens) FROM trajectories tr
                    WHERE tr.task_id = e.task_id AND tr.episode_id = e.id
                ) AS prompt_tokens, (
                    SELECT min(tr.env_state->>'stop_reason') FROM trajectories tr
                    WHERE tr.task_id = e.task_id AND tr.episode_id = e.id
                ) AS stop_reason
                FROM episodes e
                WHERE e.job_id = :j AND e.status = 'done' AND e.consumed_step IS NULL
                  AND e.claimed_step IS NULL AND e.min_policy_version IS NULL
                ORDER BY e.id
                FOR UPDATE OF e SKIP LOCKED
                """
            ),
            {"j": job_id},
        ).all()
        if not stuck:
            return []
        self.session.execute(
            text(
                """
                UPDATE episodes e SET status = 'quarantined', last_error = u.err,
                       updated_at = now()
                FROM unnest(CAST(:ids AS bigint[]), CAST(:errs AS text[])) AS u(id, err)
                WHERE e.id = u.id
                """
            ),
            {
                "ids": [r.id for r in stuck],
                "errs": [f"no sample generated a token: {ungenerated_cause(r)}" for r in stuck],
            },
        )
        self.session.execute(
            text(
                "UPDATE trajectories SET status = 'expired', updated_at = now() "
                "WHERE task_id = ANY(:tids) AND episode_id = ANY(:ids) "
                "AND status IN ('ready', 'in_progress')"
            ),
            {"tids": sorted({r.task_id for r in stuck}), "ids": [r.id for r in stuck]},
        )
        return list(stuck)

    def quarantine_nonfinite_groups(self, job_id: int) -> list[Any]:
        """Quarantine finished, unconsumed groups with a reward that is not a finite number
        (NaN, infinity): written before rewards were checked where they are produced, they would
        fail the trainer's advantages on every try. Groups reserved by a step are taken too (the
        caller releases the rest of that step's reservation). Their samples are expired.
        Returns the episodes (id, task_id, prompt_index, claimed_step, rewards)."""
        bad = self.session.execute(
            text(
                """
                SELECT e.id, e.task_id, e.prompt_index, e.claimed_step,
                       array_agg(tr.reward ORDER BY tr.sample_index) AS rewards
                FROM episodes e
                JOIN trajectories tr ON tr.task_id = e.task_id AND tr.episode_id = e.id
                WHERE e.job_id = :j AND e.status = 'done' AND e.consumed_step IS NULL
                GROUP BY e.id
                HAVING bool_or(tr.reward IN ('NaN', 'Infinity', '-Infinity'))
                ORDER BY e.id
                """
            ),
            {"j": job_id},
        ).all()
        if not bad:
            return []
        ids = [r.id for r in bad]
        self.session.execute(
            text(
                "UPDATE episodes SET status = 'quarantined', claimed_step = NULL, "
                "last_error = 'non-finite reward (' || CAST(:why AS text) || ')', "
                "updated_at = now() WHERE id = ANY(:ids)"
            ),
            {"ids": ids, "why": "NaN or infinity, written before rewards were checked"},
        )
        self.session.execute(
            text(
                "UPDATE trajectories SET status = 'expired', claimed_step = NULL, "
                "updated_at = now() WHERE task_id = ANY(:tids) AND episode_id = ANY(:ids) "
                "AND status IN ('ready', 'claimed', 'in_progress')"
            ),
            {"tids": sorted({r.task_id for r in bad}), "ids": ids},
        )
        return list(bad)

    def release_reservation(self, job_id: int, step: int) -> None:
        """Undo the reservation of ``step``'s batch (not consumed): its groups are available
        again, its claimed trajectories ``ready``; the job's pending step is cleared."""
        self.session.execute(
            text(
                """
                UPDATE trajectories tr SET status = 'ready', claimed_step = NULL,
                       updated_at = now()
                FROM episodes e
                WHERE e.job_id = :j AND e.claimed_step = :s AND e.consumed_step IS NULL
                  AND tr.task_id = e.task_id AND tr.episode_id = e.id AND tr.status = 'claimed'
                """
            ),
            {"j": job_id, "s": step},
        )
        self.session.execute(
            text(
                "UPDATE episodes SET claimed_step = NULL, updated_at = now() "
                "WHERE job_id = :j AND claimed_step = :s AND consumed_step IS NULL"
            ),
            {"j": job_id, "s": step},
        )
        self.set_pending(job_id, None, None)

    # -- claim ---------------------------------------------------------------------------------

    def reserved_groups(self, job_id: int, step: int) -> list[int]:
        return list(
            self.session.scalars(
                text(
                    "SELECT id FROM episodes WHERE job_id = :j AND claimed_step = :s "
                    "AND consumed_step IS NULL ORDER BY id"
                ),
                {"j": job_id, "s": step},
            )
        )

    def available_groups(self, job_id: int, policy_version: int) -> dict[int, int]:
        """Finished, unreserved groups within their task's staleness bound, per task."""
        rows = self.session.execute(
            text(
                """
                SELECT e.task_id, count(*) FROM episodes e JOIN tasks t ON t.id = e.task_id
                WHERE e.job_id = :j AND e.status = 'done' AND e.consumed_step IS NULL
                  AND e.claimed_step IS NULL AND t.status <> 'retired'
                  AND e.min_policy_version >= :v - t.max_staleness
                GROUP BY e.task_id
                """
            ),
            {"j": job_id, "v": policy_version},
        ).all()
        return {r[0]: int(r[1]) for r in rows}

    def reserve_groups(
        self, step: int, policy_version: int, wanted: Sequence[tuple[int, int, int]]
    ) -> list[int]:
        """Reserve for ``step``, per (task id, count, max_staleness) in ``wanted``, the
        task's ``count`` oldest eligible groups, in one statement. Returns their ids."""
        if not wanted:
            return []
        return list(
            self.session.scalars(
                text(
                    """
                    WITH picked AS (
                        SELECT p.id
                        FROM unnest(CAST(:tasks AS bigint[]), CAST(:counts AS int[]),
                                    CAST(:bounds AS int[])) AS w(task_id, n, k)
                        CROSS JOIN LATERAL (
                            SELECT e.id FROM episodes e
                            WHERE e.task_id = w.task_id AND e.status = 'done'
                              AND e.consumed_step IS NULL AND e.claimed_step IS NULL
                              AND e.min_policy_version >= :v - w.k
                            ORDER BY e.min_policy_version, e.finished_at, e.id
                            LIMIT w.n FOR UPDATE SKIP LOCKED
                        ) p
                    )
                    UPDATE episodes SET claimed_step = :s FROM picked
                    WHERE episodes.id = picked.id RETURNING episodes.id
                    """
                ),
                {
                    "tasks": [t for t, _, _ in wanted],
                    "counts": [n for _, n, _ in wanted],
                    "bounds": [k for _, _, k in wanted],
                    "v": policy_version,
                    "s": step,
                },
            )
        )

    def mark_claimed(self, job_id: int, step: int) -> int:
        """Trajectories of the step's reserved groups become ``claimed``."""
        result = self.session.execute(
            text(
                """
                UPDATE trajectories tr SET status = 'claimed', claimed_step = :s,
                       updated_at = now()
                FROM episodes e
                WHERE e.job_id = :j AND e.claimed_step = :s AND e.consumed_step IS NULL
                  AND tr.task_id = e.task_id AND tr.episode_id = e.id AND tr.status = 'ready'
                """
            ),
            {"j": job_id, "s": step},
        )
        return int(result.rowcount)  # type: ignore[attr-defined]

    def set_pending(self, job_id: int, step: int | None, mix: dict[str, Any] | None) -> None:
        self.session.execute(
            text("UPDATE jobs SET pending_step = :s, pending_mix = :m WHERE id = :j").bindparams(
                bindparam("m", type_=JSONB)
            ),
            {"j": job_id, "s": step, "m": mix},
        )

    def ready_groups(self, job_id: int, limit: int) -> list[tuple[int, int]]:
        """(episode id, task id) of finished groups no step has reserved yet, the oldest
        first (about the order claims take them in): what the next batches are made of."""
        rows = self.session.execute(
            text(
                """
                SELECT e.id, e.task_id FROM episodes e JOIN tasks t ON t.id = e.task_id
                WHERE t.job_id = :j AND e.status = 'done' AND e.consumed_step IS NULL
                  AND e.claimed_step IS NULL
                ORDER BY e.min_policy_version, e.finished_at, e.id LIMIT :n
                """
            ),
            {"j": job_id, "n": limit},
        ).all()
        return [(int(r[0]), int(r[1])) for r in rows]

    def load_trajectories(
        self, episodes: Sequence[tuple[int, int]]
    ) -> dict[int, tuple[BatchTrajectory, ...]]:
        """The committed samples of finished groups, given as (episode id, task id), by
        episode id in sample order."""
        if not episodes:
            return {}
        trajs = self.session.scalars(
            select(Trajectory)
            .where(
                Trajectory.task_id.in_(sorted({t for _, t in episodes})),
                Trajectory.episode_id.in_([e for e, _ in episodes]),
                Trajectory.status.in_(["claimed", "ready"]),
            )
            .order_by(Trajectory.episode_id, Trajectory.sample_index)
        ).all()
        by_episode: dict[int, list[BatchTrajectory]] = {}
        payloads = TrajectoryRepository(self.session).payloads(trajs, journal=False)
        for t, payload in zip(trajs, payloads, strict=True):
            assert t.reward is not None
            by_episode.setdefault(t.episode_id, []).append(
                BatchTrajectory(t.sample_index, payload, t.reward)
            )
        return {e: tuple(ts) for e, ts in by_episode.items()}

    def load_groups(
        self,
        episode_ids: Sequence[int],
        loaded: Mapping[int, tuple[BatchTrajectory, ...]] | None = None,
    ) -> list[BatchGroup]:
        """The groups with their samples; those in ``loaded`` (read earlier: a finished
        group's samples do not change) are not read again."""
        if not episode_ids:
            return []
        eps = self.session.execute(
            text(
                "SELECT e.id, e.task_id, t.name, e.prompt, e.min_policy_version FROM episodes e "
                "JOIN tasks t ON t.id = e.task_id WHERE e.id = ANY(:ids) ORDER BY e.id"
            ),
            {"ids": list(episode_ids)},
        ).all()
        loaded = loaded or {}
        samples = dict(loaded)
        samples.update(
            self.load_trajectories([(e.id, e.task_id) for e in eps if e.id not in loaded])
        )
        return [
            BatchGroup(
                episode_id=e.id,
                task_id=e.task_id,
                task_name=e.name,
                prompt=dict(e.prompt),
                min_policy_version=e.min_policy_version,
                trajectories=samples.get(e.id, ()),
            )
            for e in eps
        ]

    # -- commit and release ------------------------------------------------------------------

    def consume_step(self, job_id: int, step: int) -> tuple[int, int]:
        """Reserved groups of the step -> consumed. Returns (groups, trajectories)."""
        trajs = self.session.execute(
            text(
                """
                UPDATE trajectories tr SET status = 'consumed', consumed_at = now(),
                       claimed_step = :s, updated_at = now()
                FROM episodes e
                WHERE e.job_id = :j AND e.claimed_step = :s AND e.consumed_step IS NULL
                  AND tr.task_id = e.task_id AND tr.episode_id = e.id
                  AND tr.status IN ('claimed', 'ready')
                """
            ),
            {"j": job_id, "s": step},
        )
        groups = self.session.execute(
            text(
                "UPDATE episodes SET consumed_step = :s, updated_at = now() "
                "WHERE job_id = :j AND claimed_step = :s AND consumed_step IS NULL"
            ),
            {"j": job_id, "s": step},
        )
        return int(groups.rowcount), int(trajs.rowcount)  # type: ignore[attr-defined]

    def insert_step(
        self,
        *,
        job_id: int,
        step: int,
        policy_version: int,
        task_mix: dict[str, Any],
        num_trajectories: int,
        checkpoint_uri: str | None,
        metrics: dict[str, Any],
    ) -> None:
        self.session.execute(
            text(
                "INSERT INTO train_steps (job_id, step, policy_version, task_mix, "
                "num_trajectories, checkpoint_uri, metrics) VALUES (:j, :s, :v, :mix, :n, :c, :m)"
            ).bindparams(bindparam("mix", type_=JSONB), bindparam("m", type_=JSONB)),
            {
                "j": job_id,
                "s": step,
                "v": policy_version,
                "mix": task_mix,
                "n": num_trajectories,
                "c": checkpoint_uri,
                "m": metrics,
            },
        )

    def advance_version(self, job_id: int, version: int) -> None:
        self.session.execute(
            text(
                "UPDATE jobs SET policy_version = :v, pending_step = NULL, pending_mix = NULL, "
                "updated_at = now() WHERE id = :j"
            ),
            {"j": job_id, "v": version},
        )

    def last_checkpoint(self, job_id: int) -> tuple[int, str] | None:
        row = self.session.execute(
            text(
                "SELECT step, checkpoint_uri FROM train_steps WHERE job_id = :j "
                "AND checkpoint_uri IS NOT NULL ORDER BY step DESC LIMIT 1"
            ),
            {"j": job_id},
        ).one_or_none()
        return (int(row.step), str(row.checkpoint_uri)) if row else None

    def publish_weights(self, job_id: int, version: int, uri: str) -> None:
        self.session.execute(
            text("UPDATE jobs SET weights_version = :v, weights_uri = :u WHERE id = :j"),
            {"j": job_id, "v": version, "u": uri},
        )

    def published_weights(self, job_id: int) -> tuple[int, str] | None:
        row = self.session.execute(
            text("SELECT weights_version, weights_uri FROM jobs WHERE id = :j"), {"j": job_id}
        ).one_or_none()
        if row is None or row.weights_version is None or row.weights_uri is None:
            return None
        return int(row.weights_version), str(row.weights_uri)

    def release_claims(self, job_id: int) -> int:
        """Claimed trajectories of uncommitted steps back to ``ready``; their groups stay
        reserved for the same step, which replays them."""
        result = self.session.execute(
            text(
                """
                UPDATE trajectories tr SET status = 'ready', updated_at = now()
                FROM episodes e
                WHERE e.job_id = :j AND e.claimed_step IS NOT NULL AND e.consumed_step IS NULL
                  AND tr.task_id = e.task_id AND tr.episode_id = e.id AND tr.status = 'claimed'
                """
            ),
            {"j": job_id},
        )
        return int(result.rowcount)  # type: ignore[attr-defined]


def ungenerated_cause(row: Any) -> str:
    """Why a finished group has no generated token, from its samples: the prompt's length when
    it was tokenized, else the samples' own stop reason (an agent's prompt too long for its first
    model call never becomes tokens)."""
    if row.prompt_tokens:
        return f"the prompt ({row.prompt_tokens} tokens) reaches rollout.max_tokens"
    if row.stop_reason:
        return str(row.stop_reason)
    return "no sample made a model call"


def _step(row: Any) -> StepRow:
    return StepRow(
        step=row.step,
        policy_version=row.policy_version,
        num_trajectories=row.num_trajectories,
        task_mix=dict(row.task_mix or {}),
        checkpoint_uri=row.checkpoint_uri,
        metrics=dict(row.metrics or {}),
    )
