"""The root of a job config file (``RollcallConfig``) and the checks across its sections."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from rollcall.orchestrator import bounds as b
from rollcall.orchestrator.config.base import StrictModel
from rollcall.orchestrator.config.buffer import BufferConfig
from rollcall.orchestrator.config.control_plane import ControlPlaneConfig
from rollcall.orchestrator.config.model import DatabaseConfig, ModelConfig, RayConfig
from rollcall.orchestrator.config.rollout import RolloutConfig, VLLMEngineConfig
from rollcall.orchestrator.config.run import MetricsConfig, RunConfig
from rollcall.orchestrator.config.tasks import JobSection, TaskConfig
from rollcall.orchestrator.config.trainer import TrainerConfig
from rollcall.orchestrator.quotas import BatchPolicy, QuotaInput, batch_problem


class RollcallConfig(StrictModel):
    """The root of a job config file (``configs/*.yaml``)."""

    job: JobSection = Field(default_factory=JobSection)
    database: DatabaseConfig = Field(default_factory=DatabaseConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    tasks: list[TaskConfig] = Field(default_factory=list)
    model: ModelConfig = Field(default_factory=ModelConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    control_plane: ControlPlaneConfig = Field(default_factory=ControlPlaneConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _timeouts(self) -> RollcallConfig:
        cp, r = self.control_plane, self.rollout
        if cp.heartbeat_timeout_s <= 2 * r.heartbeat_interval_s:
            raise ValueError(
                "control_plane.heartbeat_timeout_s must exceed twice rollout.heartbeat_interval_s "
                "(one late beat must not kill a node)"
            )
        if cp.progress_timeout_s <= r.tool_timeout_s + cp.heartbeat_timeout_s:
            raise ValueError(
                "control_plane.progress_timeout_s must exceed rollout.tool_timeout_s + "
                "control_plane.heartbeat_timeout_s (agent loops wait on tools)"
            )
        return self

    @model_validator(mode="after")
    def _broadcast_fits(self) -> RollcallConfig:
        w = self.trainer.weights
        wide = [
            e
            for e in (self.rollout.engine, *self.rollout.node_engines)
            if isinstance(e, VLLMEngineConfig) and e.tensor_parallel_size != 1
        ]
        if w.transport == "collective" and wide:
            e = wide[0]
            raise ValueError(
                "trainer.weights.transport: collective broadcasts to one vLLM worker per node; "
                f"rollout.engine.tensor_parallel_size is {e.tensor_parallel_size}: use files"
            )
        return self

    @model_validator(mode="after")
    def _temperatures(self) -> RollcallConfig:
        if self.trainer.loss.temperature != self.rollout.temperature:
            raise ValueError(
                f"trainer.loss.temperature ({self.trainer.loss.temperature:g}) must equal "
                f"rollout.temperature ({self.rollout.temperature:g}): the behaviour log-probs "
                "were computed at the sampling temperature"
            )
        return self

    @model_validator(mode="after")
    def _can_progress(self) -> RollcallConfig:
        """Refuse what cannot make progress: a batch the tasks can never fill (see
        ``quotas.batch_problem``), and sweeps too slow for the timeouts they enforce."""
        cp, buf = self.control_plane, self.buffer
        if cp.dead_sweep_interval_s > cp.heartbeat_timeout_s / 4:
            raise ValueError(
                f"control_plane.dead_sweep_interval_s ({cp.dead_sweep_interval_s:g}) must be at "
                f"most a quarter of control_plane.heartbeat_timeout_s "
                f"({cp.heartbeat_timeout_s:g}): the sweep must run several times within the "
                "timeout (a gap of over half the timeout between sweeps reads as an outage, and "
                "nobody is declared dead)"
            )
        if buf.lease_s <= cp.heartbeat_timeout_s:
            raise ValueError(
                f"buffer.lease_s ({buf.lease_s:g}) must exceed control_plane.heartbeat_timeout_s "
                f"({cp.heartbeat_timeout_s:g}): a node that is still alive must not lose its "
                "leases between heartbeats"
            )
        if cp.lease_sweep_interval_s > buf.lease_s / 2:
            raise ValueError(
                f"control_plane.lease_sweep_interval_s ({cp.lease_sweep_interval_s:g}) must be "
                f"at most half of buffer.lease_s ({buf.lease_s:g}): an expired lease is requeued "
                "only when the sweep runs"
            )
        policy = BatchPolicy(buf.batch_groups, self.trainer.sync_every, self.run.mode == "sync")
        quotas = [QuotaInput(t.name, t.weight, t.max_staleness) for t in self.tasks]
        problem = batch_problem(quotas, policy, b.MAX_ADMITTED_GROUPS)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _network_tasks(self) -> RollcallConfig:
        names = {t.name for t in self.tasks}
        unknown = [n for n in self.rollout.tool_sandbox.network_tasks if n not in names]
        if unknown:
            raise ValueError(
                f"rollout.tool_sandbox.network_tasks names tasks the job does not have: "
                f"{', '.join(unknown)}"
            )
        return self

    @field_validator("tasks")
    @classmethod
    def _unique_tasks(cls, v: list[TaskConfig]) -> list[TaskConfig]:
        names = [t.name for t in v]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"task names must be unique; repeated: {', '.join(dupes)}")
        return v
