"""Trajectories: per-turn checkpoints, commits, and the samples a resumed claim continues.

Writes are fenced by the caller (``EpisodeRepository.lock_lease``) before they reach this
repository. An upsert never overwrites a committed sample: checkpoints and commits only update
rows that are still ``in_progress``, which makes a repeated commit a no-op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from orchestrator.db import raw
from orchestrator.db.models import Trajectory
from orchestrator.domain import SampleState, TrajectoryPayload, TrajectoryStatus

_COLUMNS = (
    "task_id",
    "episode_id",
    "sample_index",
    "lease_epoch",
    "token_ids",
    "loss_mask",
    "behaviour_logprobs",
    "num_tokens",
    "prompt_tokens",
    "num_turns",
    "turn_offsets",
    "turn_versions",
    "min_policy_version",
    "env_state",
    "finished",
    "status",
    "reward",
    "reward_info",
)
_UPDATED = [c for c in _COLUMNS if c not in {"task_id", "episode_id", "sample_index"}]

# One statement, compiled once: insert the sample, or update it while it is still in progress
# (a committed sample is never overwritten; RETURNING is empty for it).
_UPSERT = (
    f"INSERT INTO trajectories ({', '.join(_COLUMNS)}, ready_at) "
    f"VALUES ({', '.join(f'%({c})s' for c in _COLUMNS)}, "
    "CASE WHEN %(status)s::trajectory_status = 'ready' THEN now() END) "
    "ON CONFLICT (task_id, episode_id, sample_index) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in _UPDATED)
    + ", ready_at = excluded.ready_at, updated_at = now() "
    "WHERE trajectories.status = 'in_progress'"
)
_UPSERT_RETURNING = _UPSERT + " RETURNING sample_index"


class TrajectoryRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def upsert(
        self,
        *,
        task_id: int,
        episode_id: int,
        epoch: int,
        samples: Sequence[tuple[int, TrajectoryPayload, float | None, dict[str, Any] | None]],
    ) -> list[int]:
        """Write samples (index, payload, reward, reward_info). With a reward the sample is
        committed (``ready``); without, checkpointed (``in_progress``). Returns the sample
        indexes written; samples already committed are left untouched.

        The caller holds the episode's lease lock, so the group's rows cannot change under us.
        One sample: one statement. Several: their current statuses, then one pipelined
        ``executemany``."""
        params = [
            {
                "task_id": task_id,
                "episode_id": episode_id,
                "sample_index": index,
                "lease_epoch": epoch,
                **payload.encoded(),
                "env_state": raw.jsonb(payload.env_state),
                "status": "in_progress" if reward is None else "ready",
                "reward": reward,
                "reward_info": raw.jsonb(info or {}),
            }
            for index, payload, reward, info in samples
        ]
        cur = raw.cursor(self.session)
        if len(params) == 1:
            row = cur.execute(_UPSERT_RETURNING, params[0]).fetchone()
            return [params[0]["sample_index"]] if row is not None else []
        current = self.statuses(task_id, episode_id)
        todo = [p for p in params if current.get(p["sample_index"], "in_progress") == "in_progress"]
        if todo:
            cur.executemany(_UPSERT, todo)
        return [p["sample_index"] for p in todo]

    def write_sample(
        self,
        *,
        episode_id: int,
        epoch: int,
        sample_index: int,
        payload: TrajectoryPayload,
        reward: float | None,
        reward_info: dict[str, Any] | None,
    ) -> tuple[str, bool]:
        """Checkpoint (no reward) or commit one sample, fenced, in one statement
        (``rollcall_write_sample``, migration 0002). Returns (outcome, group_done) with outcome
        ``written``, ``already`` or ``stale``. Run it in autocommit."""
        e = payload.encoded()
        row = (
            raw.cursor(self.session)
            .execute(
                f"SELECT * FROM rollcall_write_sample({', '.join(['%s'] * 17)})",
                (
                    episode_id,
                    epoch,
                    sample_index,
                    reward is not None,
                    e["token_ids"],
                    e["loss_mask"],
                    e["behaviour_logprobs"],
                    e["num_tokens"],
                    e["prompt_tokens"],
                    e["num_turns"],
                    e["turn_offsets"],
                    e["turn_versions"],
                    e["min_policy_version"],
                    raw.jsonb(e["env_state"]),
                    e["finished"],
                    reward,
                    raw.jsonb(reward_info or {}),
                ),
            )
            .fetchone()
        )
        assert row is not None
        return row.outcome, row.group_done

    def statuses(self, task_id: int, episode_id: int) -> dict[int, str]:
        rows = (
            raw.cursor(self.session)
            .execute(
                "SELECT sample_index, status::text AS status FROM trajectories "
                "WHERE task_id = %(t)s AND episode_id = %(e)s",
                {"t": task_id, "e": episode_id},
            )
            .fetchall()
        )
        return {r.sample_index: r.status for r in rows}

    def samples_for_resume(
        self, task_id: int, episode_id: int, group_size: int
    ) -> tuple[SampleState, ...]:
        """Every sample of the group: new, in progress (with its last checkpoint), or ready."""
        rows = self.session.execute(
            select(Trajectory).where(
                Trajectory.task_id == task_id,
                Trajectory.episode_id == episode_id,
                Trajectory.status.in_([TrajectoryStatus.IN_PROGRESS, TrajectoryStatus.READY]),
            )
        ).scalars()
        found: dict[int, SampleState] = {}
        for t in rows:
            if t.status == TrajectoryStatus.READY:
                found[t.sample_index] = SampleState(t.sample_index, "ready")
            else:
                found[t.sample_index] = SampleState(
                    t.sample_index, "in_progress", TrajectoryPayload.from_columns(t)
                )
        return tuple(found.get(i, SampleState(i, "new")) for i in range(group_size))
