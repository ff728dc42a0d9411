"""The trainer as the driver sees it: ``ranks`` FSDP2 rank actors driven together.

``TrainerGroup`` creates the rank actors, forms their process group (rank 0 names the address),
and runs every collective on all ranks at once: a train step on a ``StepPlan``, publishing the
new weights, checkpoints, the final policy. A rank that dies makes the others' next collective
fail fast (gloo/NCCL), so the call raises instead of hanging. A call that hangs anyway (a rank
frozen, a collective that never completes) raises ``TrainerTimeoutError`` after
``trainer.call_timeout_s``; to the driver both are a failed trainer.
"""

from __future__ import annotations

from typing import Any

from rollcall.orchestrator.config import TrainerConfig
from rollcall.workers.trainer.batch import StepPlan
from rollcall.workers.trainer.grpo import LossStats
from rollcall.workers.trainer.rank import RankSettings, trainer_actor

SHUTDOWN_TIMEOUT_S = 30.0


class TrainerTimeoutError(TimeoutError):
    """A trainer call did not return within ``trainer.call_timeout_s``."""


class TrainerStartError(TrainerTimeoutError):
    """A trainer (re)start did not finish within its bound: the ranks were not placed within
    ``ray.placement_timeout_s`` (``placed`` False), or their set-up did not finish within
    ``trainer.start_timeout_s``."""

    def __init__(self, message: str, *, placed: bool) -> None:
        super().__init__(message)
        self.placed = placed


def wait_placed(refs: list[Any], timeout_s: float) -> None:
    """Wait for each rank's first call (``pid``: answered once Ray placed the actor and its
    process runs); ``TrainerStartError`` naming the ranks not placed within ``timeout_s``."""
    import ray

    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        missing = [str(i) for i, ref in enumerate(refs) if ref not in ready]
        raise TrainerStartError(
            f"trainer rank(s) {', '.join(missing)} not placed within {timeout_s:g} s "
            "(ray.placement_timeout_s): Ray did not start them in their reserved slots",
            placed=False,
        )
    ray.get(ready)  # an actor that died at creation raises here


class TrainerGroup:
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
        """``scheduling``: each rank's Ray scheduling strategy (its reserved slot). The ranks
        must be placed within ``placement_timeout_s`` and set up within
        ``trainer.start_timeout_s`` (``TrainerStartError`` otherwise)."""
        self.config = config
        settings = RankSettings(
            model_dir=model_dir,
            lr=config.lr,
            weight_decay=config.weight_decay,
            betas=config.betas,
            warmup_updates=config.warmup_steps * config.mini_batches,
            total_updates=total_steps * config.mini_batches,
            schedule=config.schedule,
            min_lr_ratio=config.min_lr_ratio,
            grad_clip=config.grad_clip,
            loss=config.loss.model_copy(update={"temperature": temperature}),
            device=config.device,
            seed=seed,
            threads=max(1, int(config.cpus_per_rank)),
            logprob_chunk_tokens=config.logprob_chunk_tokens,
            precision=config.precision,
            activation_checkpointing=config.activation_checkpointing,
            lora=config.lora,
            database_url=database_url,
            job_id=job_id,
            db_idle_tx_timeout_s=db_idle_tx_timeout_s,
        )
        actor = trainer_actor(
            config.cpus_per_rank, 1.0 if config.device == "cuda" else 0.0, config.resources
        )
        world = config.ranks
        self.ranks = [
            (actor.options(scheduling_strategy=scheduling[r]) if scheduling else actor).remote(
                r, world, settings
            )
            for r in range(world)
        ]
        try:
            wait_placed([r.pid.remote() for r in self.ranks], placement_timeout_s)
            bound = (config.start_timeout_s, "trainer.start_timeout_s")
            try:
                master = self._get("address", self.ranks[0].address.remote(), *bound)
                self.info = self._get("setup", [r.setup.remote(master) for r in self.ranks], *bound)
            except TrainerTimeoutError as e:
                raise TrainerStartError(str(e), placed=True) from None
        except BaseException:
            self.kill()
            raise
        self.worker_ids = [i["worker_id"] for i in self.info if i["worker_id"] is not None]

    def _get(
        self,
        method: str,
        refs: Any,
        timeout_s: float | None = None,
        field: str = "trainer.call_timeout_s",
    ) -> Any:
        import ray

        timeout = self.config.call_timeout_s if timeout_s is None else timeout_s
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TrainerTimeoutError(
                f"trainer call {method} did not return within {timeout:.0f} s ({field})"
            ) from None

    def _all(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        refs = [getattr(r, method).remote(*args) for r in self.ranks]
        return list(self._get(method, refs, timeout_s))

    def train(self, plan: StepPlan) -> dict[str, float]:
        per_rank = [[mini[r] for mini in plan.mini_batches] for r in range(len(self.ranks))]
        results = self._get(
            "train",
            [rank.train.remote(work) for rank, work in zip(self.ranks, per_rank, strict=True)],
        )
        stats = LossStats()
        for r in results:
            stats = stats + r["stats"]
        return {
            **stats.summary(),
            "loss": sum(r["loss"] for r in results),
            "grad_norm": results[0]["grad_norm"],
            "lr": results[0]["lr"],
        }

    def publish(self, root: str, version: int, background: bool = False) -> str:
        """``background``: rank 0 writes the file on a thread and keeps the tensors for a
        broadcast (collective transport)."""
        return str(self._all("publish", root, version, self.config.keep_weights, background)[0])

    def weights_offer(self) -> dict[str, Any] | None:
        """Rank 0's offer of the last published version (collective transport)."""
        offers: list[dict[str, Any] | None] = self._get(
            "weights_offer", [self.ranks[0].weights_offer.remote()]
        )
        return offers[0]

    def broadcast(self, offer: dict[str, Any]) -> Any:
        """Start rank 0's broadcast of ``offer``; the Ray reference to wait on (seconds, or
        ``BroadcastFailed``)."""
        return self.ranks[0].broadcast.remote(offer)

    def save_checkpoint(self, path: str, step: int) -> str:
        return str(self._all("save_checkpoint", path, step)[0])

    def load_checkpoint(self, path: str) -> int:
        return int(self._all("load_checkpoint", path)[0])

    def load_weights(self, location: str, version: int) -> None:
        """The model from published version ``version`` (``TrainerRank.load_published``; the
        optimizer state stays the last loaded checkpoint's, the schedule moves to the
        version's update count, recorded in its file; else estimated as ``mini_batches`` per
        step)."""
        self._all("load_published", location, version * self.config.mini_batches)

    def save_final(self, out: str) -> str:
        return str(self._all("save_final", out)[0])

    def shutdown(self) -> None:
        try:
            self._all("shutdown", timeout_s=min(SHUTDOWN_TIMEOUT_S, self.config.call_timeout_s))
        finally:
            self.kill()

    def kill(self) -> None:
        """Kill every rank now (after one died: the others may be stuck in a collective)."""
        import contextlib

        import ray

        for r in self.ranks:
            with contextlib.suppress(Exception):
                ray.kill(r, no_restart=True)
