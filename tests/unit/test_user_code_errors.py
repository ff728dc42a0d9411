"""How a failure of user code is described (``rollcall.workers.episode.usercode``) and when a task whose
code keeps failing is paused (``rollcall.workers.rollout.guard``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from rollcall.workers.episode.usercode import UserCodeError, check_reward, code_location, user_call
from rollcall.workers.rollout.guard import TaskGuard


def _inventory(sku: str) -> int:
    raise RuntimeError(f"inventory service returned 500 for {sku}")


def _agent(sku: str) -> int:
    return _inventory(sku) + 1


def _raised(fn: Any, *args: Any) -> UserCodeError:
    with pytest.raises(UserCodeError) as e:
        user_call("the agent", fn, *args)
    return e.value


def test_the_location_is_the_innermost_frame_of_the_users_code() -> None:
    e = _raised(_agent, "SKU-1")
    assert e.message == "the agent raised RuntimeError: inventory service returned 500 for SKU-1"
    assert e.location.startswith("tests/unit/test_user_code_errors.py:")
    assert e.location.endswith(" in _inventory")
    # the user's frames first (innermost last), then the whole traceback
    mine, _, whole = e.trace.partition("the whole traceback:")
    assert mine.index("in _agent") < mine.index("in _inventory")
    assert "workers/episode/usercode.py" not in mine  # rollcall's own frames are not the user's
    assert "workers/episode/usercode.py" in whole and "Traceback (most recent call last)" in whole
    assert e.kind == "raised" and not e.input_independent
    assert isinstance(e.__cause__, RuntimeError)


def test_the_same_fault_on_other_inputs_has_one_signature() -> None:
    a, b = _raised(_agent, "SKU-1"), _raised(_agent, "SKU-2")
    assert a.message != b.message and a.signature == b.signature
    assert a.head == "the agent raised RuntimeError"
    other = _raised(lambda: 1 / 0)
    assert other.signature != a.signature


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (float("nan"), "the agent's reward nan is not a finite number"),
        (float("inf"), "the agent's reward inf is not a finite number"),
        (-math.inf, "the agent's reward -inf is not a finite number"),
        ("0.5", "the agent's reward '0.5' is not a number"),
        (None, "the agent's reward None is not a number"),
        (True, "the agent's reward True is not a number"),
    ],
)
def test_a_reward_that_is_not_a_finite_number_is_the_inputs_fault(
    value: object, message: str
) -> None:
    with pytest.raises(UserCodeError) as e:
        check_reward(value, "the agent's reward", _agent)
    assert e.value.message == message and e.value.kind == "reward"
    assert e.value.location == code_location(_agent)
    assert not e.value.input_independent


def test_a_finite_real_reward_passes_as_a_float() -> None:
    assert check_reward(np.float32(0.5), "r", _agent) == 0.5
    assert check_reward(2, "r", _agent) == 2.0


def _err(message: str = "the agent raised RuntimeError: x", **kw: object) -> UserCodeError:
    return UserCodeError(message, location="agent.py:3 in rollout", **kw)  # type: ignore[arg-type]


def test_the_evidence_a_task_fails_on_most_inputs() -> None:
    from rollcall.workers.rollout.guard import needed

    # six quarantines in a row; then at least four fifths, and a binomial test against "half
    # the inputs fail" at 1/64
    assert [needed(n) for n in (5, 6, 8, 16, 32)] == [6, 6, 8, 13, 26]


def _final_outcomes(guard: TaskGuard, bad_every: int, episodes: int) -> int | None:
    """Final outcomes of episodes 1..``episodes``, every ``bad_every``-th quarantined: the
    episode at which the guard says pause, or None."""
    for episode in range(1, episodes + 1):
        error = _err() if episode % bad_every == 0 else None
        if guard.record(7, error) is not None:
            return episode
    return None


def test_a_task_one_input_in_four_of_which_fails_is_never_paused() -> None:
    assert _final_outcomes(TaskGuard(), bad_every=4, episodes=5000) is None
    assert _final_outcomes(TaskGuard(), bad_every=3, episodes=5000) is None
    assert _final_outcomes(TaskGuard(), bad_every=2, episodes=5000) is None  # half: not most


def test_a_healthy_looking_random_failure_rate_is_not_paused() -> None:
    import random

    rng = random.Random(5)
    paused = 0
    for _ in range(500):  # 500 tasks x 500 final outcomes, one input in four failing
        guard = TaskGuard()
        for _ in range(500):
            if guard.record(1, _err() if rng.random() < 1 / 4 else None) is not None:
                paused += 1
                break
    assert paused == 0


def test_a_task_failing_on_every_input_is_paused_after_six_quarantines() -> None:
    assert _final_outcomes(TaskGuard(), bad_every=1, episodes=100) == 6
    guard = TaskGuard()
    verdicts = [guard.record(7, _err()) for _ in range(6)]
    assert verdicts[:5] == [None] * 5
    v = verdicts[-1]
    assert v is not None and (v.failed, v.seen, v.count) == (6, 6, 6)
    assert v.sentence() == (
        "its code failed on 6 of the last 6 episodes that ended (each quarantined after its "
        "attempts; most often, 6 times: the agent raised RuntimeError: x at "
        "agent.py:3 in rollout)"
    )
    assert guard.record(7, _err()) is None  # one verdict: judged afresh from here


def test_most_inputs_failing_after_a_healthy_start_is_paused() -> None:
    guard = TaskGuard()
    for _ in range(40):
        assert guard.record(1, None) is None
    # then 7 of every 8 fail: paused once 26 of the last 32 have
    for episode in range(40, 200):
        if guard.record(1, None if episode % 8 == 0 else _err()) is not None:
            break
    else:
        raise AssertionError("never paused")
    assert 60 <= episode <= 80, episode


def test_an_input_independent_error_pauses_at_once() -> None:
    guard = TaskGuard()
    e = _err("the agent returned dict, not an Outcome", input_independent=True)
    v = guard.record(3, e)
    assert v is not None and v.input_independent
    assert "fails on every input" in v.sentence()
    off = TaskGuard(window=0)  # the guard off still pauses what fails on every input
    assert off.record(3, _err()) is None
    assert off.record(3, e) is not None
