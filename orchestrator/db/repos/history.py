"""Metadata retention: a job's old steps compacted into totals (``compact``, the database's
``rollcall_compact_steps``), and what the compacted rows added up to (``totals``).

What it guarantees: a compacted episode or sample is counted in ``compacted_episodes`` /
``compacted_steps`` in the same transaction that deletes it, so every reader that adds those
totals to its live rows (``rollcall status``, the metrics, the buffer's depth, the invariant
checker) answers as it did before the compaction; and a row an invariant would flag is never
compacted (the function's rule), so the checker still sees every violation.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.orm import Session

# The rule is the database's (rollcall_compact_steps, migration 0011): the runtime role has no
# DELETE on episodes or trajectories and may remove them only through it.
_COMPACT = text(
    "SELECT rollcall_compact_steps(CAST(:j AS bigint), CAST(:keep AS integer), "
    "CAST(:age_s AS double precision), CAST(:n AS integer))"
)

_TOTALS = text(
    "SELECT through_step, steps, step_trajectories, consumed_trajectories, episodes, "
    "trajectories FROM compacted_steps WHERE job_id = :j"
)


@dataclass(frozen=True)
class CompactedTotals:
    through_step: int  # every step up to this one is compacted (-1: none)
    steps: int
    step_trajectories: int  # their train_steps.num_trajectories
    consumed_trajectories: int  # consumed samples deleted
    episodes: int
    trajectories: int


NOTHING = CompactedTotals(-1, 0, 0, 0, 0, 0)


class HistoryRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def compact(self, job_id: int, keep_steps: int, min_age_s: float, max_steps: int) -> int:
        """Compact the job's steps at least ``keep_steps`` behind its last and committed more
        than ``min_age_s`` ago, at most ``max_steps`` of them; returns the episodes deleted."""
        return int(
            self.session.execute(
                _COMPACT, {"j": job_id, "keep": keep_steps, "age_s": min_age_s, "n": max_steps}
            ).scalar_one()
        )

    def totals(self, job_id: int) -> CompactedTotals:
        row = self.session.execute(_TOTALS, {"j": job_id}).one_or_none()
        if row is None:
            return NOTHING
        return CompactedTotals(*(int(v) for v in row))
