"""A committed step's bookkeeping, off the trainer's critical path (the driver runs it on its
after-step thread, in step order, while the trainer trains the next step): admission slots
filled again, the nodes' reports and the agreement watch in the step's record, the record in
``metrics.jsonl``, old checkpoints pruned, the next batch read ahead, the display moved on."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from rollcall.orchestrator.buffer.control import ControlPlaneBuffer
from rollcall.orchestrator.buffer.trainer import TrainerBuffer
from rollcall.orchestrator.config import RollcallConfig
from rollcall.orchestrator.runner.drift import DRIFT_EVENT, IsWeightWatch
from rollcall.orchestrator.runner.progress import Pace, Progress, Snapshot
from rollcall.orchestrator.runner.rundir import RunDir

log = logging.getLogger(__name__)


class StepBookkeeping:
    def __init__(
        self,
        cfg: RollcallConfig,
        run_dir: RunDir,
        control: ControlPlaneBuffer,
        trainer_buffer: TrainerBuffer,
        *,
        node_metrics: Callable[[], dict[str, float]],
        pace: Pace,
        is_weight_watch: IsWeightWatch,
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.control = control
        self.trainer_buffer = trainer_buffer
        self.node_metrics = node_metrics  # the rollout nodes' reports, for the record
        self.pace = pace  # the progress line's ETA
        self.is_weight_watch = is_weight_watch

    def after_step(
        self,
        record: dict[str, Any],
        mix: dict[str, int],
        snap: Snapshot,
        progress: Progress,
        timing: tuple[float, float, int],
    ) -> None:
        """A committed step's bookkeeping, on the after-step thread: the consumed groups'
        admission slots are filled again (first: in sync mode the next batch waits for it),
        the nodes' reports go into the step's record and the record into ``metrics.jsonl``,
        old checkpoints are pruned, up to a batch of finished groups is read ahead of the
        next claim, and the display moves on."""
        self.control.seed()
        record.update(self.node_metrics())
        self.check_is_weight(record, progress)
        self.run_dir.append(record)
        if record["checkpoint_uri"] is not None:
            self.run_dir.prune_checkpoints(self.cfg.trainer.keep_checkpoints)
        self.trainer_buffer.prefetch_groups(self.cfg.buffer.batch_groups)
        snap.reward = {k.split("/", 1)[1]: v for k, v in record.items() if k.startswith("reward/")}
        snap.mix = mix
        snap.staleness_mean = record["staleness_mean"]
        snap.staleness_max = record["staleness_max"]
        self.refresh(snap, record["policy_version"], *timing)
        progress.step_done(snap)

    def check_is_weight(self, record: dict[str, Any], progress: Progress) -> None:
        """The rollout/trainer agreement watch (``rollcall.orchestrator.runner.drift``): a warning
        (log, display, a ``trainer.is_weight_drift`` event) when the step's on-policy importance
        weight leaves the tolerance, rate-limited; ``is_weight_drift`` in the record."""
        watch = self.is_weight_watch
        notice = watch.check(record["step"], record)
        record["is_weight_drift"] = 1.0 if watch.drifting else 0.0
        if notice is None:
            return
        if notice.warning:
            log.warning("%s", notice.message)
            payload = {"step": record["step"], "weight": notice.weight}
            self.control.event(DRIFT_EVENT, notice.message, payload)
        else:
            log.info("%s", notice.message)
        progress.message(notice.message)

    def refresh(
        self, snap: Snapshot, step: int, started: float, train_s: float, steps: int
    ) -> None:
        """The progress line's figures at ``step``: time, busy fraction, ETA (``steps`` done
        by this run since ``started``), the buffer's depth and the rollout nodes."""
        elapsed = time.monotonic() - started
        snap.step = snap.version = step
        snap.elapsed_s = elapsed
        snap.busy_frac = train_s / elapsed if elapsed > 0 else 0.0
        left = self.cfg.run.total_steps - step
        snap.eta_s = self.pace.eta_s(elapsed_s=elapsed, steps=steps, left=left)
        snap.depth = self.control.depth()
        snap.nodes = [n for n in self.control.node_health() if n["role"] == "rollout"]
