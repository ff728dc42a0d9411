"""The ``run`` and ``metrics`` sections: how the job runs, its evaluation and trackers, and its
Prometheus endpoint."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from rollcall.orchestrator import bounds as b
from rollcall.orchestrator.config.base import Seconds, Steps, StrictModel, Temperature


class EvalConfig(StrictModel):
    """Reward on held-out prompts, per task, for the learning curve."""

    every: Annotated[int, b.STEPS_OR_ZERO.field()] = Field(
        default=5, description="steps between evaluations (0: start, end)"
    )
    episodes: Annotated[int, b.EPISODES.field()] = Field(
        default=32, description="held-out prompts per task (0: no evaluation at all)"
    )
    temperature: Temperature = Field(default=1.0, description="sampling temperature")
    samples: Annotated[int, b.EVAL_SAMPLES.field()] = Field(
        default=1,
        description="samples per held-out prompt (n); above 1, pass@k and mean@n are reported",
    )
    pass_k: list[Annotated[int, b.EVAL_SAMPLES.field()]] | None = Field(
        default=None,
        description="the k of pass@k, each at most samples (unset: 1 and samples)",
    )
    pass_threshold: Annotated[float, b.REWARD.field()] = Field(
        default=1.0, description="a sample passes when its reward is at least this"
    )

    @model_validator(mode="after")
    def _pass_k(self) -> EvalConfig:
        over = [k for k in self.pass_k or [] if k > self.samples]
        if over:
            raise ValueError(
                f"run.eval.pass_k has k = {over[0]} above run.eval.samples ({self.samples}): "
                "pass@k needs at least k samples of each held-out prompt"
            )
        return self

    @property
    def ks(self) -> list[int]:
        """The k of pass@k reported (none with one sample per prompt)."""
        if self.pass_k is not None:
            return sorted(set(self.pass_k))
        return [1, self.samples] if self.samples > 1 else []


class MetricsConfig(StrictModel):
    """The job driver's Prometheus endpoint (``/metrics``): numbers and labels only (job, task,
    node, status, ...), never prompts, tokens or URLs. It binds to ``host``, the loopback
    interface unless configured otherwise; put a scraper on the same host or set ``host``
    (e.g. ``0.0.0.0`` inside a pod whose port only the cluster's Prometheus reaches)."""

    enabled: bool = Field(default=False, description="serve the endpoint")
    host: str = Field(default="127.0.0.1", description="address to bind (loopback by default)")
    port: Annotated[int, b.PORT.field()] = Field(
        default=9464, description="0: any free port (printed)"
    )
    interval_s: Seconds = Field(
        default=5.0, description="seconds between collections from the database"
    )


TrackerName = Literal["tensorboard", "wandb", "mlflow"]


class TrackingConfig(StrictModel):
    """Where the experiment trackers of ``run.trackers`` write (docs/running.md#trackers)."""

    project: str = Field(
        default="rollcall",
        min_length=1,
        description="the wandb project and the MLflow experiment the job's run goes into",
    )
    wandb_mode: Literal["online", "offline"] | None = Field(
        default=None,
        description="wandb: online (needs `wandb login` or WANDB_API_KEY) or offline (a run "
        "folder in the run directory, `wandb sync` later); unset: WANDB_MODE, else online",
    )
    mlflow_uri: str | None = Field(
        default=None,
        description="MLflow tracking URI (a server, or sqlite:///FILE); unset: "
        "MLFLOW_TRACKING_URI, else sqlite in the run directory (mlflow.db)",
    )


class RunConfig(StrictModel):
    """How the job runs and where it writes (the run directory: docs/running.md)."""

    mode: Literal["async", "sync"] = Field(
        default="async",
        description="async: rollout never stops, trained data up to each task's max_staleness "
        "versions old; sync: the baseline, every staleness bound 0 and one batch admitted "
        "(trainer.sync_every must be 1)",
    )
    total_steps: Steps = Field(default=20, description="train steps the job runs to")
    seed: Annotated[int, b.SEED.field()] = Field(default=0, description="random seed")
    dir: str | None = Field(default=None, description="default: ROLLCALL_HOME/runs/JOB")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="held-out evaluation")
    trackers: list[TrackerName] = Field(
        default_factory=lambda: list[TrackerName](["tensorboard"]),
        description="experiment trackers that get every step's metrics, the evaluations with "
        "their intervals, the config and the learning curve: tensorboard (event files in the "
        "run directory), wandb (pip install 'rollcall[wandb]'), mlflow ('rollcall[mlflow]'); "
        "[] for none. A resumed job continues the same runs",
    )
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig, description="where the trackers write"
    )
    log_max_mb: Annotated[int, b.LOG_MB.field()] = Field(
        default=b.LOG_MB_DEFAULT,
        description="driver.log rotates when it would grow past this many MB (driver.log.1 "
        "is the one before)",
    )
    log_backups: Annotated[int, b.LOG_BACKUPS.field()] = Field(
        default=b.LOG_BACKUPS_DEFAULT,
        description="rotated driver.log files kept (driver.log.1 .. driver.log.N; older "
        "ones are deleted)",
    )

    @field_validator("trackers")
    @classmethod
    def _distinct_trackers(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("run.trackers names a tracker twice")
        return v
