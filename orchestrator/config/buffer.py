"""The ``buffer`` section: the replay buffer's policy."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from rollcall.orchestrator import bounds as b
from rollcall.orchestrator.config.base import Seconds, SecondsOrZero, StrictModel


class BufferConfig(StrictModel):
    """The replay buffer's policy, job-wide (see docs/architecture.md, "Quotas and the replay
    buffer"). A task's outstanding work is admitted up to ``ceil((max_staleness + 1) *
    batch_share)`` groups, ``batch_share = batch_groups * weight / total weight``."""

    batch_groups: Annotated[int, b.BATCH_GROUPS.field()] = Field(
        default=8, description="groups (prompts x group) per train step"
    )
    lease_s: Seconds = Field(default=60.0, description="episode lease, renewed by heartbeats")
    max_attempts: Annotated[int, b.ATTEMPTS.field()] = Field(
        default=3, description="claims of an episode before quarantine"
    )
    claim_window_s: Seconds = Field(
        default=120.0, description="time constant of the recent-claims score (fair share)"
    )
    retry_backoff_s: SecondsOrZero = Field(
        default=2.0,
        description="an episode whose user code failed is claimable again after this many "
        "seconds times 2^(attempt-1), at most 300 (twice that on the node it failed on)",
    )
    retry_window_s: SecondsOrZero | None = Field(
        default=None,
        description="how long a database operation is retried during an outage (< lease_s); "
        "default min(30, lease_s / 2)",
    )
    payload_retention_steps: Annotated[int, b.RETENTION_STEPS.field()] | None = Field(
        default=100,
        description="payloads (tokens, masks, log-probs) of trajectories consumed this many "
        "steps ago, and of groups expired before then, are dropped; their metadata (rewards, "
        "versions, steps) stays; null: kept",
    )
    payload_retention_s: Seconds | None = Field(
        default=None,
        description="also drop the payloads of steps committed longer ago than this; null: no "
        "age limit",
    )
    metadata_retention_steps: Annotated[int, b.RETENTION_STEPS.field()] | None = Field(
        default=200,
        description="metadata retention: the episodes and samples trained this many steps "
        "ago (and never in the last hour), and the expired episodes that ended before then, "
        "are compacted into per-task totals, their rows deleted; the per-step summaries "
        "(train_steps) and quarantined episodes stay, and status, metrics and the invariant "
        "checks answer as before; null: kept",
    )

    @property
    def retry_window(self) -> float:
        if self.retry_window_s is not None:
            return self.retry_window_s
        return min(30.0, self.lease_s / 2)

    @model_validator(mode="after")
    def _retry_within_lease(self) -> BufferConfig:
        if self.retry_window_s is not None and self.retry_window_s >= self.lease_s:
            raise ValueError(
                f"buffer.retry_window_s ({self.retry_window_s:g}) must be less than "
                f"buffer.lease_s ({self.lease_s:g}): an outage the writers ride out must not "
                "expire the leases they hold"
            )
        return self
