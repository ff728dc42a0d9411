"""The rollout fleet: how many rollout nodes a running job should have (``jobs.rollout_nodes``)
and each slot's state as the supervisor sees it (``rollout_slots``)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session


class FleetRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def set_size(self, job_id: int, nodes: int) -> bool:
        """The rollout nodes the job should have; False: no such job."""
        done = self.session.execute(
            text("UPDATE jobs SET rollout_nodes = :n WHERE id = :j RETURNING id"),
            {"n": nodes, "j": job_id},
        ).one_or_none()
        return done is not None

    def size(self, job_id: int) -> int | None:
        """The rollout nodes the job should have (None: not set, the config's)."""
        return self.session.execute(
            text("SELECT rollout_nodes FROM jobs WHERE id = :j"), {"j": job_id}
        ).scalar_one_or_none()

    def record(
        self,
        job_id: int,
        name: str,
        *,
        state: str,
        reason: str | None,
        ray_node_id: str | None,
        restarts: int,
        max_restarts: int,
        machine_losses: int,
    ) -> None:
        """The slot's state now (``state_since`` moves only when the state changes)."""
        self.session.execute(
            text(
                """
                INSERT INTO rollout_slots (job_id, name, state, ray_node_id, restarts,
                                           max_restarts, machine_losses, reason)
                VALUES (:j, :n, :s, :node, :r, :m, :l, :why)
                ON CONFLICT (job_id, name) DO UPDATE SET
                    state_since = CASE WHEN rollout_slots.state = EXCLUDED.state
                                       THEN rollout_slots.state_since ELSE now() END,
                    state = EXCLUDED.state, ray_node_id = EXCLUDED.ray_node_id,
                    restarts = EXCLUDED.restarts, max_restarts = EXCLUDED.max_restarts,
                    machine_losses = EXCLUDED.machine_losses, reason = EXCLUDED.reason,
                    updated_at = now()
                """
            ),
            {
                "j": job_id,
                "n": name,
                "s": state,
                "node": ray_node_id,
                "r": restarts,
                "m": max_restarts,
                "l": machine_losses,
                "why": reason,
            },
        )

    def forget(self, job_id: int) -> None:
        """A new run of the job starts its fleet afresh: the earlier run's slots are
        ``removed`` until this run records them (an update: the runtime role deletes
        nothing)."""
        self.session.execute(
            text(
                "UPDATE rollout_slots SET state = 'removed', reason = 'a slot of an earlier run', "
                "state_since = now(), updated_at = now() "
                "WHERE job_id = :j AND state <> 'removed'"
            ),
            {"j": job_id},
        )

    def slots(self, job_id: int) -> list[dict[str, Any]]:
        """Every slot of the job with how long it has been in its state (database clock)."""
        rows = self.session.execute(
            text(
                """
                SELECT name, state, ray_node_id, restarts, max_restarts, machine_losses, reason,
                       extract(epoch FROM now() - state_since) AS state_age_s
                FROM rollout_slots WHERE job_id = :j
                ORDER BY length(name), name
                """
            ),
            {"j": job_id},
        ).all()
        return [{**r._asdict(), "state_age_s": float(r.state_age_s)} for r in rows]
