"""GroupCommit (orchestrator/buffer/groupcommit.py): writes that arrive while a batch is being
written form the next batch; each caller gets its own result or its batch's error."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from rollcall.orchestrator.buffer.groupcommit import GroupCommit, Pending


def _wait_for(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


class Recorder:
    """A write_batch that records its batches and can hold the first one until released."""

    def __init__(self, fail_on: Any = None) -> None:
        self.batches: list[list[Any]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.fail_on = fail_on

    def __call__(self, batch: list[Pending]) -> None:
        self.batches.append([p.item for p in batch])
        self.entered.set()
        assert self.release.wait(30)
        if self.fail_on is not None and any(p.item == self.fail_on for p in batch):
            raise ValueError(f"cannot write {self.fail_on}")
        for p in batch:
            p.settle(("written", p.item))


def test_one_writer_alone_writes_one_batch_per_write() -> None:
    rec = Recorder()
    group = GroupCommit(rec)
    assert [group.submit(i) for i in range(3)] == [("written", i) for i in range(3)]
    assert rec.batches == [[0], [1], [2]]
    assert (group.batches, group.writes) == (3, 3)


def _behind_a_held_batch(
    group: GroupCommit, rec: Recorder, items: list[Any]
) -> tuple[Any, dict[Any, Any]]:
    """The leader's write ("lead") is held in its batch until every item's writer waits behind
    it, then released: (the leader's result, each item's result or error)."""
    out: dict[Any, Any] = {}

    def submit(item: Any) -> None:
        try:
            out[item] = group.submit(item)
        except Exception as e:
            out[item] = e

    rec.release.clear()
    leader = threading.Thread(target=submit, args=("lead",))
    leader.start()
    assert rec.entered.wait(30)
    threads = [threading.Thread(target=submit, args=(i,)) for i in items]
    for t in threads:
        t.start()
    _wait_for(lambda: len(group._queue) == len(items))
    rec.release.set()
    for t in [leader, *threads]:
        t.join(30)
        assert not t.is_alive()
    return out.pop("lead"), out


def test_writes_that_arrive_during_a_batch_share_the_next_one() -> None:
    rec = Recorder()
    group = GroupCommit(rec)
    lead, out = _behind_a_held_batch(group, rec, list(range(6)))
    assert lead == ("written", "lead")
    assert out == {i: ("written", i) for i in range(6)}
    assert rec.batches[0] == ["lead"]
    assert sorted(rec.batches[1]) == list(range(6))  # one transaction for the six
    assert (group.batches, group.writes) == (2, 7)


def test_a_failed_batch_fails_each_of_its_writes_and_the_next_batch_goes_on() -> None:
    rec = Recorder(fail_on=3)
    group = GroupCommit(rec)
    _, out = _behind_a_held_batch(group, rec, [1, 2, 3])
    assert all(isinstance(out[i], ValueError) for i in (1, 2, 3))
    assert group.submit(4) == ("written", 4)


def test_a_batch_is_at_most_max_batch_writes() -> None:
    rec = Recorder()
    group = GroupCommit(rec, max_batch=2)
    _, out = _behind_a_held_batch(group, rec, list(range(5)))
    assert out == {i: ("written", i) for i in range(5)}
    assert [len(b) for b in rec.batches] == [1, 2, 2, 1]


def test_a_write_the_batch_left_unsettled_is_an_error_not_a_silent_success() -> None:
    group = GroupCommit(lambda batch: None)
    with pytest.raises(RuntimeError, match="without a result"):
        group.submit("x")
