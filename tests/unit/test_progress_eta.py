"""The ETA of a run's progress line: the pace of steps since the first one of this run.

The first step of a run also waits for the rollout nodes to start and to roll out the first
full batch (about a minute of the quickstart's 80 five-second steps), so an ETA that counts it
as a step shows an hour at step 1 of a ten-minute run."""

from __future__ import annotations

import pytest

from rollcall.orchestrator.runner.progress import Pace


def test_no_eta_before_the_second_step() -> None:
    pace = Pace()
    assert pace.eta_s(elapsed_s=60.0, steps=0, left=80) is None
    assert pace.eta_s(elapsed_s=65.0, steps=1, left=79) is None


def test_the_eta_is_the_pace_since_the_first_step() -> None:
    pace = Pace()
    pace.eta_s(elapsed_s=65.0, steps=1, left=79)  # 60 s of start-up, then a 5 s step
    assert pace.eta_s(elapsed_s=75.0, steps=3, left=77) == pytest.approx(5.0 * 77)


def test_the_first_step_is_the_first_one_seen() -> None:
    """Steps can be reported late (the display runs after the step's bookkeeping): the first
    report with a step done fixes the start of the pace."""
    pace = Pace()
    pace.eta_s(elapsed_s=70.0, steps=2, left=78)
    assert pace.eta_s(elapsed_s=80.0, steps=4, left=76) == pytest.approx(5.0 * 76)
    assert pace.eta_s(elapsed_s=90.0, steps=4, left=76) == pytest.approx(10.0 * 76)
