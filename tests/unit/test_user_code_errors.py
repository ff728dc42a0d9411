"""How a failure of user code is described (``workers.rollout.usercode``) and when a task whose
code keeps failing is paused (``workers.rollout.guard``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from workers.rollout.guard import TaskGuard
from workers.rollout.usercode import UserCodeError, check_reward, code_location, user_call


def _inventory(sku: str) -> int:
    raise RuntimeError(f"inventory service returned 500 for {sku}")


def _agent(sku: str) -> int:
    return _inventory(sku) + 1


def _raised(fn, *args):  # type: ignore[no-untyped-def]
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
    assert "workers/rollout/usercode.py" not in mine  # rollcall's own frames are not the user's
    assert "workers/rollout/usercode.py" in whole and "Traceback (most recent call last)" in whole
    assert e.kind == "raised" and not e.input_independent
    assert isinstance(e.__cause__, RuntimeError)


def test_the_same_fault_on_other_inputs_has_one_signature() -> None:
    a, b = _raised(_agent, "SKU-1"), _raised(_agent, "SKU-2")
    assert a.message != b.message and a.signature == b.signature
    assert a.head == "the agent raised RuntimeError"
    other = _raised(lambda: 1 / 0)
    assert other.signature != a.signature


def test_calling_the_function_itself_failed_is_input_independent() -> None:
    e = _raised(_agent)  # a missing argument: no frame of the user's code ran
    assert isinstance(e.__cause__, TypeError) and e.input_independent
    assert e.location.endswith(" in _agent")  # where the function is defined
    raised_inside = _raised(lambda: int("x") + None)  # type: ignore[operator]
    assert not raised_inside.input_independent


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


def test_one_prompt_in_four_failing_and_retried_never_pauses_the_task() -> None:
    guard = TaskGuard(window=8, min_episodes=4)
    retries: list[int] = []
    for episode in range(1, 200):
        if episode % 4 == 1:
            retries += [episode] * 3  # fails three times, later each time (backoff)
        else:
            assert guard.record(7, episode, None) is None
        # retries come late, after the episode left the window
        if len(retries) > 6:
            assert guard.record(7, retries.pop(0), _err()) is None


def test_a_task_failing_on_every_input_is_paused_after_min_episodes() -> None:
    guard = TaskGuard(window=8, min_episodes=4)
    verdicts = [guard.record(7, episode, _err()) for episode in range(1, 5)]
    assert verdicts[:3] == [None, None, None]
    v = verdicts[3]
    assert v is not None and (v.failed, v.seen, v.count) == (4, 4, 4)
    assert v.sentence() == (
        "its code failed on 4 of its last 4 episodes (most often, 4 times: the agent raised "
        "RuntimeError: x at agent.py:3 in rollout)"
    )
    # judged afresh after the verdict (an operator resumed the task)
    assert guard.record(7, 5, _err()) is None


def test_more_than_half_failing_pauses_and_half_does_not() -> None:
    guard = TaskGuard(window=8, min_episodes=4)
    outcomes = [None, _err(), None, _err(), None, _err(), None, _err()]  # 4 of 8: not more
    assert all(guard.record(1, i, e) is None for i, e in enumerate(outcomes))
    assert guard.record(1, 100, _err()) is not None  # 5 of the last 8


def test_an_input_independent_error_pauses_at_once() -> None:
    guard = TaskGuard(window=8, min_episodes=4)
    e = _err("the agent returned dict, not an Outcome", input_independent=True)
    v = guard.record(3, 1, e)
    assert v is not None and v.input_independent
    assert "fails on every input" in v.sentence()
    off = TaskGuard(window=0)  # the guard off still pauses what fails on every input
    assert off.record(3, 1, _err()) is None
    assert off.record(3, 2, e) is not None
