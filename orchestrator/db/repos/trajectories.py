"""Trajectories: per-turn checkpoints, commits, and the samples a resumed claim continues.

Writes are fenced by the caller (``EpisodeRepository.lock_lease``) before they reach this
repository. An upsert never overwrites a committed sample: checkpoints and commits only update
rows that are still ``in_progress``, which makes a repeated commit a no-op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from orchestrator.buffer.types import SampleState, TrajectoryPayload
from orchestrator.db.models import Trajectory
from orchestrator.domain import TrajectoryStatus

_PAYLOAD_COLUMNS = (
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
)


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
        indexes written; samples already committed are left untouched."""
        rows = []
        for index, payload, reward, info in samples:
            row: dict[str, Any] = {
                "task_id": task_id,
                "episode_id": episode_id,
                "sample_index": index,
                "lease_epoch": epoch,
                **payload.encoded(),
                "status": TrajectoryStatus.IN_PROGRESS
                if reward is None
                else TrajectoryStatus.READY,
                "reward": reward,
                "reward_info": info or {},
                "ready_at": None if reward is None else func.now(),
            }
            rows.append(row)
        stmt = insert(Trajectory).values(rows)
        columns = (*_PAYLOAD_COLUMNS, "lease_epoch", "status", "reward", "reward_info", "ready_at")
        update: dict[str, Any] = {c: stmt.excluded[c] for c in columns}
        update["updated_at"] = func.now()
        upsert = stmt.on_conflict_do_update(
            index_elements=["task_id", "episode_id", "sample_index"],
            set_=update,
            where=Trajectory.status == TrajectoryStatus.IN_PROGRESS,
        ).returning(Trajectory.sample_index)
        return list(self.session.scalars(upsert))

    def group_progress(self, task_id: int, episode_id: int) -> tuple[int, int | None]:
        """(committed samples, oldest policy version among them) of one group."""
        row = self.session.execute(
            text(
                "SELECT count(*), min(min_policy_version) FROM trajectories "
                "WHERE task_id = :t AND episode_id = :e AND status = 'ready'"
            ),
            {"t": task_id, "e": episode_id},
        ).one()
        return int(row[0]), row[1]

    def statuses(self, task_id: int, episode_id: int) -> dict[int, str]:
        rows = self.session.execute(
            text(
                "SELECT sample_index, status::text FROM trajectories "
                "WHERE task_id = :t AND episode_id = :e"
            ),
            {"t": task_id, "e": episode_id},
        ).all()
        return {r[0]: r[1] for r in rows}

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

    def load(self, task_id: int, episode_id: int) -> list[Trajectory]:
        return list(
            self.session.scalars(
                select(Trajectory)
                .where(Trajectory.task_id == task_id, Trajectory.episode_id == episode_id)
                .order_by(Trajectory.sample_index)
            )
        )
