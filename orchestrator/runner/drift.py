"""The rollout/trainer agreement watch: a warning when the importance weight of on-policy tokens
strays from 1.

On tokens that the trainer's current weights generated (a trajectory 0 versions behind, every
token of a sync job) pi_old / pi_behaviour is 1 but for numerics; a larger gap means the
rollout does not sample from the policy the trainer trains (a dtype or kernel mismatch, another
temperature, weights loaded wrong). Stale tokens are left out: in async mode their weight moves
for a legitimate reason. The statistic is the geometric mean weight exp(mean log w) of the
step's on-policy tokens (``is_log_weight_onpolicy_mean``, from the trainer): the arithmetic
mean is 1 in expectation under any mismatch, the geometric one is exp(-KL(behaviour || policy))
and only 1 when they agree. A step without on-policy tokens leaves the state as it is.

One warning when a step goes out of ``trainer.is_weight_tolerance``, again at most every
``trainer.is_weight_warn_every`` steps while it stays out, and one line when it is back within.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

DRIFT_EVENT = "trainer.is_weight_drift"


@dataclass(frozen=True)
class DriftNotice:
    warning: bool  # True: out of tolerance (a warning); False: back within it
    message: str
    weight: float


class IsWeightWatch:
    def __init__(self, tolerance: float, warn_every: int) -> None:
        self.tolerance = tolerance
        self.warn_every = warn_every
        self.drifting = False
        self._warned_at: int | None = None

    def check(self, step: int, metrics: Mapping[str, float]) -> DriftNotice | None:
        """What to say about step ``step`` (its trainer metrics), if anything."""
        log_mean = metrics.get("is_log_weight_onpolicy_mean")
        if log_mean is None:
            return None
        weight = math.exp(log_mean)
        tokens = int(metrics.get("onpolicy_tokens", 0))
        if abs(weight - 1.0) > self.tolerance:
            again = self._warned_at is not None and step - self._warned_at >= self.warn_every
            if self.drifting and not again:
                return None
            self.drifting, self._warned_at = True, step
            return DriftNotice(
                True,
                f"step {step}: the on-policy importance weight is {weight:.4f} over {tokens} "
                f"tokens (tolerance 1 +- {self.tolerance:g}, trainer.is_weight_tolerance): the "
                "rollout's behaviour log-probs do not match the trainer's for the same weights "
                "(dtype, temperature or weight loading)",
                weight,
            )
        if not self.drifting:
            return None
        self.drifting, self._warned_at = False, None
        return DriftNotice(
            False,
            f"step {step}: the on-policy importance weight is back within tolerance "
            f"({weight:.4f} over {tokens} tokens)",
            weight,
        )
