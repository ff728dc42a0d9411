"""The on-policy importance-weight watch: a warning when the weight leaves the tolerance, at most
every ``warn_every`` steps while it stays out, a line when it is back; stale-only steps (no
on-policy token) change nothing."""

from __future__ import annotations

import math

from rollcall.orchestrator.runner.drift import IsWeightWatch


def _step(weight: float | None) -> dict[str, float]:
    if weight is None:  # no on-policy token in the step
        return {"onpolicy_tokens": 0.0, "is_weight_mean": 0.7}
    return {"onpolicy_tokens": 100.0, "is_log_weight_onpolicy_mean": math.log(weight)}


def test_warns_once_per_episode_of_drift_and_again_every_n_steps() -> None:
    watch = IsWeightWatch(tolerance=0.05, warn_every=3)
    weights = [1.0, 1.01, 1.2, 1.2, None, 1.2, 0.9, 0.9, 1.0, 1.0, 0.8]
    said = {}
    for step, w in enumerate(weights):
        notice = watch.check(step, _step(w))
        if notice is not None:
            said[step] = notice.warning
    # out at 2 (warned), still out at 3 (quiet), no on-policy token at 4, again at 5 (3 steps
    # after 2), quiet at 6 and 7, back at 8 (one line), out again at 10 (a warning at once)
    assert said == {2: True, 5: True, 8: False, 10: True}
    assert watch.drifting


def test_the_message_names_the_weight_and_the_config_key() -> None:
    notice = IsWeightWatch(tolerance=0.05, warn_every=100).check(7, _step(1.105))
    assert notice is not None and notice.warning
    assert notice.weight == 1.105 or abs(notice.weight - 1.105) < 1e-12
    assert "step 7" in notice.message and "1.1050" in notice.message
    assert "trainer.is_weight_tolerance" in notice.message


def test_a_step_without_onpolicy_tokens_says_nothing() -> None:
    watch = IsWeightWatch(tolerance=0.05, warn_every=1)
    assert watch.check(0, _step(None)) is None
    assert watch.check(1, {}) is None
    assert not watch.drifting
