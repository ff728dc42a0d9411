"""A training step's critical path, up to its commit: plan the batch, train, checkpoint,
publish the new weights, commit the step; with the collective transport, the committed
version is then broadcast to the live nodes. What only reports on a step is the driver's
after-step bookkeeping."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from rollcall.orchestrator.buffer.trainer import TrainerBuffer
from rollcall.orchestrator.config import RollcallConfig
from rollcall.orchestrator.runner import broadcast
from rollcall.orchestrator.runner.broadcast import Broadcaster
from rollcall.orchestrator.runner.rundir import RunDir
from rollcall.workers.trainer.batch import plan_step

log = logging.getLogger(__name__)


def train_step(
    batch: Any,
    cfg: RollcallConfig,
    trainer: Any,
    run_dir: RunDir,
    buffer: TrainerBuffer,
    *,
    collective: bool,
    after_train: Callable[[], None] | None = None,
    broadcast: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Train ``batch`` and commit its step; the step's record. ``collective``: the weights
    also go over collectives (``broadcast``, called after the commit with the new version);
    ``after_train``: the fault-injection hook, after the optimizer stepped."""
    tc = cfg.trainer
    step = batch.step
    t0 = time.monotonic()
    plan = plan_step(
        batch,
        tc.loss,
        ranks=tc.ranks,
        micro_batch_tokens=tc.micro_batch_tokens,
        mini_batches=tc.mini_batches,
    )
    t1 = time.monotonic()
    metrics = trainer.train(plan)
    if after_train is not None:
        after_train()
    t2 = time.monotonic()
    last = step + 1 == cfg.run.total_steps
    ckpt = None
    if (step + 1) % tc.checkpoint_every == 0 or last:
        ckpt = trainer.save_checkpoint(str(run_dir.checkpoint_path(step)), step)
    t3 = time.monotonic()
    weights_uri = None
    if (step + 1) % tc.sync_every == 0 or last:
        if not collective:
            weights_uri = trainer.publish(str(run_dir.weights), step + 1)
        else:
            # the file is written off the critical path when this step's checkpoint holds
            # the same weights; else it is what a restarted trainer resumes from: at once
            weights_uri = trainer.publish(
                str(run_dir.weights), step + 1, background=ckpt is not None
            )
    t4 = time.monotonic()
    record: dict[str, Any] = {
        "kind": "step",
        "step": step,
        "policy_version": step + 1,
        **plan.metrics,
        **metrics,
        "plan_s": t1 - t0,
        "train_s": t2 - t1,
        "checkpoint_s": t3 - t2,
        "publish_s": t4 - t3,
        "checkpoint_uri": ckpt,
        "weights_uri": weights_uri,
        "replayed": batch.replayed,
        "expired_groups": batch.expired_groups,
        "prefetched_groups": batch.prefetched_groups,
    }
    buffer.commit_step(
        step,
        checkpoint_uri=ckpt,
        weights_uri=weights_uri,
        metrics={k: v for k, v in record.items() if isinstance(v, int | float)},
    )
    record["commit_s"] = time.monotonic() - t4
    if weights_uri is not None and collective and broadcast is not None:
        t5 = time.monotonic()
        broadcast(step + 1)
        record["broadcast_s"] = time.monotonic() - t5
    return record


def broadcast_version(
    broadcaster: Broadcaster, version: int, trainer: Any, supervisor: Any, buffer: TrainerBuffer
) -> None:
    """Collective transport: the committed version to the live nodes (``broadcast.py``).
    Never fails the step, which is committed: whoever missed the version loads its file."""
    try:
        result = broadcaster.run(version, trainer, supervisor.book.members())
    except Exception as e:  # the trainer died: found by its next call
        log.warning("broadcasting version %s failed: %s", version, e)
        result = {
            "version": version,
            "members": [],
            "epochs": [],
            "loaded": [],
            "dropped": [],
            "errors": {"trainer": f"{type(e).__name__}: {e}"[:300]},
        }
    buffer.event(broadcast.EVENT, broadcast.describe(result), result)
    # the nodes up that did not get it load its file now rather than after grace_s
    for name, actor in supervisor.book.named_actors():
        if name not in result["loaded"]:
            actor.weights_missed.remote(version)
