"""The job driver's trainer: start it (from the last checkpoint or newer published weights
when the job has trained before), and recover it when it fails.

``TrainerControl`` is an object the driver (``rollcall.orchestrator.runner.driver``) holds,
given what it needs: the config, the database, the job, the trainer's buffer (for the
requeue of dead ranks, the return of the uncommitted batch's claims and the events), the
job's reservation and the console. It keeps the trainer handle and the failure count; the
driver keeps the step it is at and passes it in.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from rollcall.orchestrator.domain import WorkerStatus
from rollcall.orchestrator.errors import ConflictError
from rollcall.workers.trainer.factory import make_trainer
from rollcall.workers.trainer.group import TrainerStartError, TrainerTimeoutError

if TYPE_CHECKING:
    from pathlib import Path

    from rich.console import Console

    from rollcall.orchestrator.buffer.trainer import TrainerBuffer
    from rollcall.orchestrator.config import RollcallConfig
    from rollcall.orchestrator.db.engine import Database


log = logging.getLogger(__name__)


class TrainerControl:
    def __init__(
        self,
        cfg: RollcallConfig,
        db: Database,
        job_id: int,
        buffer: TrainerBuffer,
        *,
        model_dir: Path,
        placement: Any,
        console: Console,
    ) -> None:
        self.cfg = cfg
        self.db = db
        self.job_id = job_id
        self.buffer = buffer
        self.model_dir = model_dir
        self.placement = placement  # the job's reserved slots (None: none)
        self.console = console
        self.trainer: Any = None
        self.version: int | None = None  # the job's policy version at the last start
        self.restarts = 0  # failures within trainer.restart_window_s
        self.failures: list[float] = []

    def start(self) -> int:
        """Start the trainer group, restored to the job's last state when it has trained
        before; returns the job's policy version (the step the trainer is at)."""
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
                step = self.version = state.policy_version
                last = tx.batches.last_checkpoint(self.job_id)
                published = tx.batches.published_weights(self.job_id)
            if step > 0:
                self._restore(step, last, published)
        except BaseException:  # a half-started trainer must not keep its slots
            self.trainer.kill()
            self.trainer = None
            raise
        return step

    def shutdown(self) -> None:
        """Stop the trainer (its ranks save nothing more); logged, never raised."""
        if self.trainer is None:
            return
        try:
            self.trainer.shutdown()
        except Exception:
            log.exception("stopping the trainer failed")
        self.trainer = None

    def _restore(
        self, step: int, last: tuple[int, str] | None, published: tuple[int, str] | None
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
                f"job {self.cfg.job.name!r} is at step {step} but has no checkpoint and "
                "no published weights to resume the trainer from"
            )
        restored = ckpt_version
        if last is not None:
            self.trainer.load_checkpoint(last[1])
        if published is not None and pub_version > ckpt_version:
            self.trainer.load_weights(published[1], pub_version)
            restored = pub_version
        if restored < step:
            self.console.print(
                f"warning: the updates of steps {restored + 1}..{step} were lost with the "
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

    def recover(self, error: BaseException, step: int) -> int:
        """A rank died (or a collective failed): kill the group, return the uncommitted batch's
        claims, and start a new group from the last committed checkpoint (or newer published
        weights) in the same reserved slots; the loop then replays the same batch for the same
        step. Each failure, and each start that fails (not placed within
        ``ray.placement_timeout_s``, not set up within ``trainer.start_timeout_s``), counts
        against ``trainer.max_restarts`` within ``trainer.restart_window_s``; every one is an
        event (``trainer.down``, ``trainer.start_failed``, then ``trainer.restarted`` or
        ``trainer.failed``). Returns the step the new trainer is at."""
        old = self.trainer
        old.kill()
        self.trainer = None
        for wid in old.worker_ids:
            self.buffer.requeue_worker(wid, WorkerStatus.DEAD)
        released = self.buffer.release_trainer_claims()
        budget = self.cfg.trainer.max_restarts
        reason = failure_reason(error)
        self._count_failure()
        # the failure is on record before any restart is tried (which may take long, or fail)
        self.buffer.event(
            "trainer.down",
            f"trainer down at step {step} ({released} claimed trajectories returned for "
            f"replay): {reason}",
            {"step": step, "reason": reason, "failures": self.restarts},
        )
        while True:
            if self.restarts > budget:
                self.buffer.event(
                    "trainer.failed",
                    f"trainer failed {self.restarts} times (budget {budget}): {reason}",
                    {"step": step, "reason": reason},
                )
                self.console.print(
                    f"trainer FAILED at step {step}: {self.restarts} failures "
                    f"within trainer.restart_window_s, over trainer.max_restarts ({budget}); "
                    f"the job stops ({reason})",
                    markup=False,
                )
                raise error
            self.console.print(
                f"trainer failed at step {step} ({reason}); restarting from the last "
                f"checkpoint (restart {self.restarts}/{budget})",
                markup=False,
            )
            t0 = time.monotonic()
            try:
                step = self.start()
            except Exception as e:
                if not is_trainer_failure(e):
                    raise
                error, reason = e, self._start_failure(e)
                self._count_failure()
                self.buffer.event(
                    "trainer.start_failed",
                    f"trainer restart at step {step} failed after "
                    f"{time.monotonic() - t0:.1f} s: {reason}",
                    {"step": step, "reason": reason, "failures": self.restarts},
                )
                self.console.print(f"trainer restart failed: {reason}", markup=False)
                continue
            self.buffer.event(
                "trainer.restarted",
                f"trainer restarted at step {step} in {time.monotonic() - t0:.1f} s "
                f"({released} claimed trajectories returned for replay): {reason}",
                {"step": step, "reason": reason, "restart": self.restarts},
            )
            return step

    def _count_failure(self) -> None:
        now = time.monotonic()
        window = self.cfg.trainer.restart_window_s
        self.failures = [t for t in self.failures if now - t <= window] + [now]
        self.restarts = len(self.failures)

    def _start_failure(self, e: BaseException) -> str:
        """Why a trainer start failed, with the reservation's state when the ranks were not
        placed (RESCHEDULING: a Ray node that held slots was lost, none has room for them)."""
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

    return isinstance(e, ray.exceptions.RayError | TrainerTimeoutError)
