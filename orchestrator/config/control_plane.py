"""The ``control_plane`` section: the driver's scheduler jobs."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from rollcall.orchestrator import bounds as b
from rollcall.orchestrator.config.base import Seconds, StrictModel


class ControlPlaneConfig(StrictModel):
    """The scheduler jobs of the driver (APScheduler). A dead or hung rollout node is declared
    dead within heartbeat_interval_s + heartbeat_timeout_s + dead_sweep_interval_s (a hung
    engine that still beats: progress_timeout_s + dead_sweep_interval_s)."""

    seed_interval_s: Seconds = Field(
        default=1.0, description="seconds between seeding passes (queueing new episodes)"
    )
    lease_sweep_interval_s: Seconds = Field(
        default=5.0,
        description="seconds between sweeps that requeue expired leases; at most "
        "buffer.lease_s / 2",
    )
    staleness_interval_s: Seconds = Field(
        default=5.0, description="seconds between staleness-expiry passes"
    )
    dead_sweep_interval_s: Seconds = Field(
        default=1.0,
        description="seconds between dead-worker sweeps; at most heartbeat_timeout_s / 4",
    )
    heartbeat_timeout_s: Seconds = Field(
        default=10.0,
        description="a worker whose last beat is older is declared dead and its leases "
        "requeued; less than buffer.lease_s, more than twice rollout.heartbeat_interval_s",
    )
    progress_timeout_s: Seconds = Field(
        default=30.0, description="a rollout node generating nothing this long is hung"
    )
    supervise_interval_s: Seconds = Field(
        default=1.0, description="seconds between supervisor passes (restarting down nodes)"
    )
    retention_interval_s: Seconds = Field(
        default=30.0,
        description="seconds between retention passes (buffer.payload_retention_steps, "
        "buffer.payload_retention_s, event_retention_s, event_retention_count)",
    )
    event_retention_s: Annotated[float, b.EVENT_RETENTION_S.field()] | None = Field(
        default=7 * 86_400.0,
        description="the job's events (its audit log) older than this are deleted, except "
        "its newest event of each kind; null: kept",
    )
    event_retention_count: Annotated[int, b.EVENT_RETENTION_COUNT.field()] | None = Field(
        default=100_000,
        description="the job's events beyond its newest this many are deleted too, except "
        "those of the last hour and its newest event of each kind; null: no cap",
    )
