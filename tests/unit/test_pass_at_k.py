"""pass@k and mean@n of the held-out evaluation: the unbiased estimator against a brute-force
count over every k-subset of fixed outcomes, the evaluation record, trackers and summary, and
a pass@k asked of more samples than a prompt has."""

from __future__ import annotations

import itertools

import pytest
from pydantic import ValidationError

from rollcall.orchestrator.config import EvalConfig
from rollcall.orchestrator.evalstats import pass_at_k, pass_changes, pass_rates
from rollcall.orchestrator.runner.evals import eval_record
from rollcall.orchestrator.runner.trackers import scalars_of


def _brute(outcomes: list[bool], k: int) -> float:
    """The share of the k-subsets of the n samples that hold at least one pass."""
    subsets = list(itertools.combinations(range(len(outcomes)), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize(
    "outcomes",
    [
        [False] * 6,
        [True] * 5,
        [True, False, False, False, False, False, False, False],
        [False, True, False, True, False, False, True],
        [True, True, False, True, False, False, True, False, False, True],
    ],
)
def test_pass_at_k_is_the_share_of_k_subsets_with_a_pass(outcomes: list[bool]) -> None:
    for k in range(1, len(outcomes) + 1):
        assert pass_at_k(outcomes, k) == pytest.approx(_brute(outcomes, k), abs=1e-12), k


def test_pass_at_1_is_the_pass_rate_and_k_must_fit() -> None:
    assert pass_at_k([True, False, False, False], 1) == pytest.approx(0.25)
    # one pass in 8: pass@4 = 1 - C(7, 4) / C(8, 4) = 1 - 35 / 70
    assert pass_at_k([True] + [False] * 7, 4) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="1 <= k <= the 4 samples"):
        pass_at_k([True] * 4, 5)


def test_pass_rates_average_over_prompts_with_a_threshold() -> None:
    # prompt 0: rewards 1, 0.5, 0 (one pass at threshold 1); prompt 1: 0, 0, 0.
    samples = [[1.0, 0.5, 0.0], [0.0, 0.0, 0.0]]
    got = pass_rates(samples, [1, 3], threshold=1.0)
    assert got["pass@1"] == pytest.approx((1 / 3 + 0) / 2)
    assert got["pass@3"] == pytest.approx((1 + 0) / 2)
    assert got["mean@3"] == pytest.approx((0.5 + 0) / 2)
    # at threshold 0.5 the second sample of prompt 0 passes too: pass@1 = (2/3) / 2
    assert pass_rates(samples, [1], threshold=0.5)["pass@1"] == pytest.approx(1 / 3)


def test_eval_record_trackers_and_summary() -> None:
    e = EvalConfig(episodes=2, samples=4, pass_k=[1, 2])
    first = eval_record(0, {"calc": [[0, 0, 0, 1], [0, 0, 0, 0]]}, e)
    last = eval_record(5, {"calc": [[1, 1, 0, 1], [0, 1, 0, 0]]}, e)
    # per prompt, the mean of its samples (intervals and gains are over prompts)
    assert first["rewards"] == {"calc": [0.25, 0.0]} and first["reward"] == {"calc": 0.125}
    # pass@2 of prompt 0 in `last`: 1 - C(1, 2) / C(4, 2) = 1; of prompt 1: 1 - C(3, 2) / 6
    assert last["pass"]["calc"]["pass@2"] == pytest.approx((1 + (1 - 3 / 6)) / 2)
    assert last["pass"]["calc"]["mean@4"] == pytest.approx((0.75 + 0.25) / 2)
    assert last["samples"]["calc"][1] == [0, 1, 0, 0]
    _, step, values = scalars_of(last) or (None, None, {})
    assert step == 5 and values["eval/calc/pass@1"] == pytest.approx(0.5)
    changes = pass_changes([first, last])
    assert changes[0][0] == "calc" and ("pass@1", 0.125, 0.5) in changes[0][1]
    # one sample per prompt: the record is as before
    single = eval_record(0, {"calc": [[1.0], [0.0]]}, EvalConfig(episodes=2))
    assert "pass" not in single and single["rewards"] == {"calc": [1.0, 0.0]}


def test_pass_at_k_above_the_samples_is_one_sentence() -> None:
    with pytest.raises(ValidationError, match=r"pass_k has k = 8 above run.eval.samples \(4\)"):
        EvalConfig(samples=4, pass_k=[2, 8])
    assert EvalConfig(samples=4).ks == [1, 4] and EvalConfig().ks == []
    with pytest.raises(ValidationError, match="samples"):
        EvalConfig(samples=0)
