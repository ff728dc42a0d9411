"""What the trainer loop checks while it waits for a full batch: whether anything can still
fill one (a rollout node that can run, a task that is not paused), and what it waits for, for
the progress line. A job that nothing will feed stops with the reason."""

from __future__ import annotations

import time
from typing import Any

from rollcall.orchestrator.buffer.control import ControlPlaneBuffer
from rollcall.orchestrator.config import RollcallConfig
from rollcall.orchestrator.domain import TaskStatus, paused_sentence
from rollcall.orchestrator.errors import JobFailedError, TasksPausedError
from rollcall.orchestrator.runner.placement import rollout_bundle
from rollcall.orchestrator.runner.usererrors import UserErrorReport

# How often the wait for a batch looks whether every task is paused (check_tasks_left)
TASKS_CHECK_INTERVAL_S = 2.0


class StallChecks:
    def __init__(self, cfg: RollcallConfig, buffer: ControlPlaneBuffer) -> None:
        self.cfg = cfg
        self.buffer = buffer
        self._tasks_checked_at = 0.0  # when the wait for a batch last looked at the tasks

    def check_nodes_left(self, sup: Any, step: int) -> None:
        """Every rollout node slot is over its restart budget, or none could be placed for
        ``rollout.capacity_wait_s``: nothing will fill a batch."""
        waited = sup.book.waiting_for_capacity() if sup is not None else None
        limit = self.cfg.rollout.capacity_wait_s
        if waited is not None and waited > limit:
            bundle = ", ".join(f"{v:g} {k}" for k, v in rollout_bundle(self.cfg).items())
            self.buffer.event(
                "job.no_capacity",
                f"no rollout node could run for {waited:.0f} s; the job stops at step {step}",
                {"step": step, "waited_s": waited},
            )
            raise JobFailedError(
                f"job {self.cfg.job.name!r} stopped at step {step}: no rollout node could "
                f"run for {waited:.0f} s (rollout.capacity_wait_s {limit:g}): no machine in the "
                f"Ray cluster has room for one ({bundle}); add machines, or lower "
                "rollout.cpus_per_node, rollout.gpus_per_node or rollout.resources, and "
                "continue with --resume"
            )
        if sup is not None and sup.book.all_failed:
            why = "; ".join(sup.book.failures())
            self.buffer.event(
                "job.no_rollout_nodes",
                f"every rollout node failed; the job stops at step {step}: {why}",
                {"step": step, "failures": sup.book.failures()},
            )
            raise JobFailedError(
                f"job {self.cfg.job.name!r} stopped at step {step}: every rollout node "
                f"failed over its restart budget (rollout.max_restarts); fix the cause and "
                f"continue with --resume ({why})"
            )

    def waiting_for(self, sup: Any) -> str:
        """What the trainer loop waits for, for the progress line."""
        waited = sup.book.waiting_for_capacity() if sup is not None else None
        if waited is not None:
            return (
                f"waiting for capacity: no rollout node can run ({waited:.0f} s of "
                f"rollout.capacity_wait_s {self.cfg.rollout.capacity_wait_s:g})"
            )
        return "waiting for a full batch from the rollout nodes"

    def check_tasks_left(self, step: int, user_errors: UserErrorReport | None) -> None:
        """Every task is paused, at least one by the user-code guard, and nothing is in flight:
        nothing will fill a batch. The job stops with the reasons (after the last user-code
        errors are shown: ``user_errors``); it continues with ``--resume`` once the
        tasks are resumed."""
        now = time.monotonic()
        if now - self._tasks_checked_at < TASKS_CHECK_INTERVAL_S:
            return
        self._tasks_checked_at = now
        tasks = self.buffer.tasks()
        if not tasks or any(t.status is not TaskStatus.PAUSED for t in tasks):
            return
        guarded = [t for t in tasks if t.status_reason]
        if not guarded or self.buffer.depth().get("leased", 0):
            return
        if user_errors is not None:
            user_errors.close()
        reasons = "; ".join(
            paused_sentence(t.name, t.job_name, t.status_reason or "") for t in guarded
        )
        self.buffer.event(
            "job.tasks_paused",
            f"every task is paused; the job stops at step {step}: {reasons}",
            {"step": step, "tasks": {t.name: t.status_reason for t in guarded}},
        )
        raise TasksPausedError(
            f"job {self.cfg.job.name!r} stopped at step {step}: every task is paused. {reasons}"
        )
