"""The job driver's trainer: start it (from the last checkpoint or newer published weights
when the job has trained before), and recover it when it fails.

A mixin of ``JobDriver`` (``orchestrator.runner.driver``): it works on the driver's config,
database, buffer, placement and console, and keeps the trainer handle and its failure count
on the driver, where the loop, the metrics and the tests read them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from orchestrator.errors import ConflictError

if TYPE_CHECKING:
    from pathlib import Path

    from rich.console import Console

    from orchestrator.buffer.service import Buffer
    from orchestrator.config import RollcallConfig
    from orchestrator.db.engine import Database


class TrainerControl:
    cfg: RollcallConfig
    db: Database
    buffer: Buffer
    console: Console
    model_dir: Path
    job_id: int
    step: int
    trainer: Any
    placement: Any
    trainer_restarts: int
    trainer_failures: list[float]

    def _start_trainer(self) -> None:
        from workers.trainer.factory import make_trainer

        cfg = self.cfg
        self.trainer = make_trainer(
            cfg.trainer,
            str(self.model_dir),
            total_steps=cfg.run.total_steps,
            seed=cfg.run.seed,
            temperature=cfg.rollout.temperature,
            database_url=self.db.url.render_as_string(hide_password=False),
            job_id=self.job_id,
            scheduling=self.placement.trainer_strategies() if self.placement else None,
            placement_timeout_s=cfg.ray.placement_timeout_s,
            db_idle_tx_timeout_s=cfg.control_plane.heartbeat_timeout_s,
        )
        try:
            with self.db.transaction() as tx:
                state = tx.batches.job_state(self.job_id)
                self.step = state.policy_version
                last = tx.batches.last_checkpoint(self.job_id)
                published = tx.batches.published_weights(self.job_id)
            if self.step > 0:
                self._restore_trainer(last, published)
        except BaseException:  # a half-started trainer must not keep its slots
            self.trainer.kill()
            self.trainer = None
            raise

    def _restore_trainer(
        self, last: tuple[int, str] | None, published: tuple[int, str] | None
    ) -> None:
        """Bring the new trainer to the newest state the job kept: the last checkpoint (model,
        optimizer, schedule; the checkpoint of step k holds version k + 1), then, when a
        version published since is newer, that version's weights (the optimizer keeps the
        checkpoint's moments; the schedule moves to the version). So the weights the trainer
        continues from are the last published ones or a descendant of them, never older: no
        weights older than a version the nodes saw get published under a newer version."""
        ckpt_version = last[0] + 1 if last is not None else 0
        pub_version = published[0] if published is not None else 0
        if max(ckpt_version, pub_version) == 0:
            raise ConflictError(
                f"job {self.cfg.job.name!r} is at step {self.step} but has no checkpoint and "
                "no published weights to resume the trainer from"
            )
        restored = ckpt_version
        if last is not None:
            self.trainer.load_checkpoint(last[1])
        if published is not None and pub_version > ckpt_version:
            self.trainer.load_weights(published[1], pub_version)
            restored = pub_version
        if restored < self.step:
            self.console.print(
                f"warning: the updates of steps {restored + 1}..{self.step} were lost with the "
                "trainer (neither checkpointed nor published; their trajectories stay "
                f"consumed); training continues from version {restored}'s weights. Set "
                "trainer.checkpoint_every: 1 or trainer.sync_every: 1 to lose none.",
                markup=False,
            )
        # lines count steps from 1 ("step 12/15", "stopped at step 12": 12 committed); the
        # checkpoint's row is 0-based (step 11 is the twelfth)
        parts = [f"the checkpoint of step {last[0] + 1} ({last[1]})"] if last is not None else []
        if published is not None and restored > ckpt_version:
            parts.append(
                f"the weights published as version {pub_version} ({published[1]}), newer "
                "than the checkpoint (its optimizer state kept)"
            )
        self.console.print(f"resumed the trainer from {' and '.join(parts)}", markup=False)

    def _recover_trainer(self, error: BaseException) -> None:
        """A rank died (or a collective failed): kill the group, return the uncommitted batch's
        claims, and start a new group from the last committed checkpoint (or newer published
        weights) in the same reserved slots; the loop then replays the same batch for the same
        step. Each failure, and each start that fails (not placed within
        ``ray.placement_timeout_s``, not set up within ``trainer.start_timeout_s``), counts
        against ``trainer.max_restarts`` within ``trainer.restart_window_s``; every one is an
        event (``trainer.down``, ``trainer.start_failed``, then ``trainer.restarted`` or
        ``trainer.failed``)."""
        from orchestrator.domain import WorkerStatus

        old = self.trainer
        old.kill()
        self.trainer = None
        for wid in old.worker_ids:
            self.buffer.requeue_worker(wid, WorkerStatus.DEAD)
        released = self.buffer.release_trainer_claims()
        budget = self.cfg.trainer.max_restarts
        reason = failure_reason(error)
        self._count_trainer_failure()
        # the failure is on record before any restart is tried (which may take long, or fail)
        self.buffer.event(
            "trainer.down",
            f"trainer down at step {self.step} ({released} claimed trajectories returned for "
            f"replay): {reason}",
            {"step": self.step, "reason": reason, "failures": self.trainer_restarts},
        )
        while True:
            if self.trainer_restarts > budget:
                self.buffer.event(
                    "trainer.failed",
                    f"trainer failed {self.trainer_restarts} times (budget {budget}): {reason}",
                    {"step": self.step, "reason": reason},
                )
                self.console.print(
                    f"trainer FAILED at step {self.step}: {self.trainer_restarts} failures "
                    f"within trainer.restart_window_s, over trainer.max_restarts ({budget}); "
                    f"the job stops ({reason})",
                    markup=False,
                )
                raise error
            self.console.print(
                f"trainer failed at step {self.step} ({reason}); restarting from the last "
                f"checkpoint (restart {self.trainer_restarts}/{budget})",
                markup=False,
            )
            t0 = time.monotonic()
            try:
                self._start_trainer()
            except Exception as e:
                if not is_trainer_failure(e):
                    raise
                error, reason = e, self._start_failure(e)
                self._count_trainer_failure()
                self.buffer.event(
                    "trainer.start_failed",
                    f"trainer restart at step {self.step} failed after "
                    f"{time.monotonic() - t0:.1f} s: {reason}",
                    {"step": self.step, "reason": reason, "failures": self.trainer_restarts},
                )
                self.console.print(f"trainer restart failed: {reason}", markup=False)
                continue
            self.buffer.event(
                "trainer.restarted",
                f"trainer restarted at step {self.step} in {time.monotonic() - t0:.1f} s "
                f"({released} claimed trajectories returned for replay): {reason}",
                {"step": self.step, "reason": reason, "restart": self.trainer_restarts},
            )
            return

    def _count_trainer_failure(self) -> None:
        now = time.monotonic()
        window = self.cfg.trainer.restart_window_s
        self.trainer_failures = [t for t in self.trainer_failures if now - t <= window] + [now]
        self.trainer_restarts = len(self.trainer_failures)

    def _start_failure(self, e: BaseException) -> str:
        """Why a trainer start failed, with the reservation's state when the ranks were not
        placed (RESCHEDULING: a Ray node that held slots was lost, none has room for them)."""
        from workers.trainer.group import TrainerStartError

        reason = failure_reason(e)
        if isinstance(e, TrainerStartError) and not e.placed and self.placement is not None:
            reason += f" (the job's reservation is {self.placement.state()})"
        return reason


def failure_reason(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def is_trainer_failure(e: BaseException) -> bool:
    """A failure of the trainer's processes (a dead rank, a failed collective, a call that
    did not return within ``trainer.call_timeout_s``), as opposed to a bug in the driver or
    the database being down."""
    import ray.exceptions

    from workers.trainer.group import TrainerTimeoutError

    return isinstance(e, ray.exceptions.RayError | TrainerTimeoutError)
