"""``rollout.capacity_wait_s``: a job none of whose rollout nodes could be placed for that long
stops with one sentence naming the wait, the bundle and the fix, and a ``job.no_capacity``
event; under it, the progress line says what the job waits for. The book's wait is what the
supervisor sets (``waiting_since``: every live slot waits for a machine or for Ray's word)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from rollcall.orchestrator.config import RollcallConfig
from rollcall.orchestrator.errors import JobFailedError
from rollcall.orchestrator.runner.slots import Slot
from rollcall.orchestrator.runner.slotviews import SlotBook
from rollcall.orchestrator.runner.stalls import StallChecks


class Events:  # a fake control-plane buffer: the events it was given
    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def event(self, kind: str, message: str, payload: dict[str, Any]) -> None:
        self.events.append((kind, message, payload))


def _setup(waited: float | None) -> tuple[StallChecks, Events, Any]:
    cfg = RollcallConfig.model_validate(
        {"job": {"name": "capacity"}, "rollout": {"capacity_wait_s": 30, "cpus_per_node": 2}}
    )
    events = Events()
    book = SlotBook(events, [Slot("rollout-0", 0)])  # type: ignore[arg-type]
    if waited is not None:
        book.waiting_since = time.monotonic() - waited
    return StallChecks(cfg, events), events, SimpleNamespace(book=book)  # type: ignore[arg-type]


def test_a_job_that_waited_past_capacity_wait_s_stops_with_the_fix() -> None:
    stalls, events, sup = _setup(waited=41.0)
    with pytest.raises(JobFailedError) as stopped:
        stalls.check_nodes_left(sup, 12)
    said = str(stopped.value)
    assert "stopped at step 12: no rollout node could run for 41 s" in said, said
    assert "rollout.capacity_wait_s 30" in said and "2 CPU" in said, said
    assert "continue with --resume" in said, said
    [(kind, message, payload)] = events.events
    assert kind == "job.no_capacity" and payload["step"] == 12 and payload["waited_s"] >= 41
    assert "the job stops at step 12" in message


def test_a_job_within_capacity_wait_s_goes_on_and_says_what_it_waits_for() -> None:
    stalls, events, sup = _setup(waited=10.0)
    stalls.check_nodes_left(sup, 12)  # no stop
    assert events.events == []
    assert stalls.waiting_for(sup).startswith("waiting for capacity: no rollout node can run (10 s")
    stalls, events, sup = _setup(waited=None)  # a node is up or starting: no wait at all
    stalls.check_nodes_left(sup, 12)
    assert stalls.waiting_for(sup) == "waiting for a full batch from the rollout nodes"
