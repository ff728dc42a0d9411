"""A timing model of the trainer, for benchmarks (``trainer.timing_model``; see
``ops/bench/pipeline.py``). Not a trainer: the weights never change.

``TimingTrainerGroup`` has ``TrainerGroup``'s interface, so the job driver runs its normal
loop over it: claim a batch, plan it, ``train``, checkpoint, ``publish``, commit the step.
One Ray actor (``TimingTrainerRank``) stands for the whole trainer. It registers as a trainer
worker and heartbeats like a real rank, receives the planned batch through Ray like a real
rank, and sleeps the modelled time of each phase (simulated seconds x ``time_scale``):

- ``train``: ``step_s + s_per_token x tokens`` (every token of the batch's sequences);
- ``save_checkpoint``: ``checkpoint_s``, then a small checkpoint folder written aside and
  renamed into place;
- ``publish``: ``publish_s``, then a weights file of ``publish_bytes`` bytes (safetensors,
  numpy) published by version with ``weights.publish_with``, which rollout nodes read.

No torch is imported.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

from rollcall.orchestrator.buffer.rollout import RolloutBuffer
from rollcall.orchestrator.config import TimingTrainerConfig, TrainerConfig
from rollcall.orchestrator.db.engine import open_database
from rollcall.orchestrator.domain import WorkerRole, WorkerStatus
from rollcall.workers.trainer.batch import StepPlan, TrainSequence
from rollcall.workers.trainer.group import TrainerStartError, wait_placed
from rollcall.workers.weights import publish_with

HEARTBEAT_INTERVAL_S = 2.0


def step_seconds(config: TimingTrainerConfig, tokens: int) -> float:
    """Modelled (simulated) seconds of one optimizer step over ``tokens`` tokens."""
    return config.step_s + config.s_per_token * tokens


class TimingTrainerRank:
    def __init__(
        self,
        config: TimingTrainerConfig,
        *,
        lr: float = 0.0,
        database_url: str | None = None,
        job_id: int | None = None,
        db_idle_tx_timeout_s: float = 60.0,
        sleep: Any = time.sleep,
    ) -> None:
        self.config = config
        self.lr = lr
        self.database_url = database_url
        self.job_id = job_id
        self.db_idle_tx_timeout_s = db_idle_tx_timeout_s
        self.worker_id: int | None = None
        self.modelled_s = 0.0
        self._sleep = sleep
        self._stop = threading.Event()
        self.buffer: Any = None

    def pid(self) -> int:
        return os.getpid()

    def setup(self) -> dict[str, Any]:
        if self.database_url is not None and self.job_id is not None:
            self._register(self.database_url, self.job_id)
        return {"rank": 0, "pid": os.getpid(), "worker_id": self.worker_id}

    def _register(self, database_url: str, job_id: int) -> None:

        db = open_database(database_url, pool_size=1, idle_tx_timeout_s=self.db_idle_tx_timeout_s)
        self.buffer = RolloutBuffer(db, job_id)
        self.worker_id = self.buffer.register_worker(
            "trainer-0", role=WorkerRole.TRAINER, host=socket.gethostname(), pid=os.getpid()
        ).id

        def beat() -> None:
            while not self._stop.wait(HEARTBEAT_INTERVAL_S):
                with contextlib.suppress(Exception):  # a rank holds no leases
                    self.buffer.beat(self.worker_id or 0)

        threading.Thread(target=beat, name="heartbeat", daemon=True).start()

    def _pause(self, seconds: float) -> None:
        self.modelled_s += seconds
        self._sleep(seconds * self.config.time_scale)

    def train(self, mini_batches: list[list[list[TrainSequence]]]) -> dict[str, Any]:
        tokens = sum(len(s.token_ids) for mini in mini_batches for mb in mini for s in mb)
        self._pause(step_seconds(self.config, tokens))
        return {"loss": 0.0, "grad_norm": 0.0, "lr": self.lr, "tokens_trained": tokens}

    def publish(self, root: str, version: int, keep: int) -> str:
        import numpy as np
        from safetensors.numpy import save_file

        self._pause(self.config.publish_s)
        blob = {"weights": np.zeros(self.config.publish_bytes, dtype=np.uint8)}
        return publish_with(
            lambda path: save_file(blob, str(path), metadata={"version": str(version)}),
            Path(root),
            version,
            keep=keep,
        )

    def save_checkpoint(self, path: str, step: int) -> str:
        self._pause(self.config.checkpoint_s)
        final = Path(path)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "timing_model.json").write_text(json.dumps({"step": step}))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        return str(final)

    def load_checkpoint(self, path: str) -> int:
        return int(json.loads((Path(path) / "timing_model.json").read_text())["step"])

    def save_final(self, out: str) -> str:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "TIMING_MODEL.txt").write_text("a benchmark timing model: no weights\n")
        return out

    def modelled_seconds(self) -> float:
        return self.modelled_s

    def shutdown(self) -> None:
        self._stop.set()
        if self.worker_id is not None and self.buffer is not None:
            self.buffer.requeue_worker(self.worker_id, WorkerStatus.STOPPED)


class TimingTrainerGroup:
    """``TrainerGroup``'s interface over one ``TimingTrainerRank`` actor."""

    def __init__(
        self,
        config: TrainerConfig,
        model_dir: str,
        *,
        total_steps: int,
        seed: int = 0,
        temperature: float = 1.0,
        database_url: str | None = None,
        job_id: int | None = None,
        scheduling: list[Any] | None = None,
        placement_timeout_s: float = 120.0,
        db_idle_tx_timeout_s: float = 60.0,
    ) -> None:
        import ray

        assert config.timing_model is not None
        self.config = config
        actor = timing_trainer_actor(config.cpus_per_rank, config.resources)
        if scheduling:
            actor = actor.options(scheduling_strategy=scheduling[0])
        self.rank: Any = actor.remote(
            config.timing_model,
            lr=config.lr,
            database_url=database_url,
            job_id=job_id,
            db_idle_tx_timeout_s=db_idle_tx_timeout_s,
        )
        try:
            wait_placed([self.rank.pid.remote()], placement_timeout_s)
            try:
                self.info = [ray.get(self.rank.setup.remote(), timeout=config.start_timeout_s)]
            except ray.exceptions.GetTimeoutError:
                raise TrainerStartError(
                    f"trainer call setup did not return within {config.start_timeout_s:.0f} s "
                    "(trainer.start_timeout_s)",
                    placed=True,
                ) from None
        except BaseException:
            self.kill()
            raise
        self.worker_ids = [i["worker_id"] for i in self.info if i["worker_id"] is not None]

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.rank, method).remote(*args))

    def train(self, plan: StepPlan) -> dict[str, float]:
        # The whole batch goes to the one actor, as a one-rank group would send it.
        work = [[mb for rank in mini for mb in rank] for mini in plan.mini_batches]
        return dict(self._call("train", work))

    def publish(self, root: str, version: int) -> str:
        return str(self._call("publish", root, version, self.config.keep_weights))

    def save_checkpoint(self, path: str, step: int) -> str:
        return str(self._call("save_checkpoint", path, step))

    def load_checkpoint(self, path: str) -> int:
        return int(self._call("load_checkpoint", path))

    def load_weights(self, location: str, version: int) -> None:
        """Nothing to load: the timing model's weights never change."""

    def save_final(self, out: str) -> str:
        return str(self._call("save_final", out))

    def modelled_seconds(self) -> float:
        return float(self._call("modelled_seconds"))

    def shutdown(self) -> None:
        try:
            self._call("shutdown")
        finally:
            self.kill()

    def kill(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.rank, no_restart=True)


def timing_trainer_actor(num_cpus: float = 0.1, resources: dict[str, float] | None = None) -> Any:
    import ray

    return ray.remote(num_cpus=num_cpus, resources=resources or {}, max_restarts=0)(
        TimingTrainerRank
    )
