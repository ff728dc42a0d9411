"""Trajectories: per-turn checkpoints, commits, and the samples a resumed claim continues.

Every write is one call of ``rollcall_write_sample`` (migration 0002), which fences it by the
lease epoch, never overwrites a committed sample (checkpoints and commits only update rows that
are still ``in_progress``, which makes a repeated commit a no-op), and marks the episode done
when its group's last sample is committed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from orchestrator.db import raw
from orchestrator.db.models import Trajectory
from orchestrator.domain import SampleState, TrajectoryPayload, TrajectoryStatus

# Checkpoint (no reward) or commit one sample, fenced by the lease epoch, in one statement:
# fencing, the write that never overwrites a committed sample, the idempotent re-commit and the
# group's completion are all ``rollcall_write_sample`` (migration 0002).
_WRITE_SAMPLE = f"SELECT * FROM rollcall_write_sample({', '.join(['%s'] * 17)})"


def _write_params(
    episode_id: int,
    epoch: int,
    sample_index: int,
    payload: TrajectoryPayload,
    reward: float | None,
    reward_info: dict[str, Any] | None,
) -> tuple[Any, ...]:
    e = payload.encoded()
    return (
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
    )


class TrajectoryRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

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
        row = (
            raw.cursor(self.session)
            .execute(
                _WRITE_SAMPLE,
                _write_params(episode_id, epoch, sample_index, payload, reward, reward_info),
            )
            .fetchone()
        )
        assert row is not None
        return row.outcome, row.group_done

    def write_samples(
        self,
        *,
        episode_id: int,
        epoch: int,
        samples: Sequence[tuple[int, TrajectoryPayload, float | None, dict[str, Any] | None]],
    ) -> list[tuple[str, bool]]:
        """``write_sample`` for several samples (index, payload, reward, reward_info) of one
        group, pipelined in the caller's transaction; one (outcome, group_done) per sample.

        The first write locks the episode (``FOR UPDATE`` for a commit, ``FOR SHARE`` for a
        checkpoint) until the transaction ends, so the lease cannot move on between them: if any
        sample is ``stale``, none was written."""
        if not samples:
            return []
        cur = raw.cursor(self.session)
        cur.executemany(
            _WRITE_SAMPLE,
            [_write_params(episode_id, epoch, i, p, r, info) for i, p, r, info in samples],
            returning=True,
        )
        out: list[tuple[str, bool]] = []
        while True:
            row = cur.fetchone()
            assert row is not None
            out.append((row.outcome, row.group_done))
            if not cur.nextset():
                break
        return out

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
