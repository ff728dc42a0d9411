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


def _joined(threads: list[threading.Thread], out: dict[Any, Any]) -> dict[Any, Any]:
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    return out


def test_one_writer_alone_writes_one_batch_per_write() -> None:
    rec = Recorder()
    group = GroupCommit(rec)
    assert [group.submit(i) for i in range(3)] == [("written", i) for i in range(3)]
    assert rec.batches == [[0], [1], [2]]
    assert (group.batches, group.writes) == (3, 3)


def test_writes_that_arrive_during_a_batch_share_the_next_one() -> None:
    rec = Recorder()
    rec.release.clear()
    group = GroupCommit(rec)
    first: dict[str, Any] = {}
    leader = threading.Thread(target=lambda: first.setdefault("r", group.submit("lead")))
    leader.start()
    assert rec.entered.wait(30)
    out: dict[Any, Any] = {}
    threads = [
        threading.Thread(target=lambda i=i: out.setdefault(i, group.submit(i))) for i in range(6)
    ]
    for t in threads:
        t.start()
    _wait_for(lambda: len(group._queue) == 6)
    rec.release.set()
    leader.join(30)
    _joined(threads, out)
    assert first["r"] == ("written", "lead")
    assert out == {i: ("written", i) for i in range(6)}
    assert rec.batches[0] == ["lead"]
    assert sorted(rec.batches[1]) == list(range(6))  # one transaction for the six
    assert (group.batches, group.writes) == (2, 7)


def test_a_failed_batch_fails_each_of_its_writes_and_the_next_batch_goes_on() -> None:
    rec = Recorder(fail_on=3)
    rec.release.clear()
    group = GroupCommit(rec)
    leader = threading.Thread(target=lambda: group.submit("lead"))
    leader.start()
    assert rec.entered.wait(30)
    out: dict[Any, Any] = {}
    threads = [threading.Thread(target=lambda i=i: _catch(out, i, group)) for i in (1, 2, 3)]
    for t in threads:
        t.start()
    _wait_for(lambda: len(group._queue) == 3)
    rec.release.set()
    leader.join(30)
    _joined(threads, out)
    assert all(isinstance(out[i], ValueError) for i in (1, 2, 3))
    assert group.submit(4) == ("written", 4)


def _catch(out: dict[Any, Any], i: Any, group: GroupCommit) -> None:
    try:
        out[i] = group.submit(i)
    except ValueError as e:
        out[i] = e


def test_a_batch_is_at_most_max_batch_writes() -> None:
    rec = Recorder()
    rec.release.clear()
    group = GroupCommit(rec, max_batch=2)
    leader = threading.Thread(target=lambda: group.submit("lead"))
    leader.start()
    assert rec.entered.wait(30)
    out: dict[Any, Any] = {}
    threads = [
        threading.Thread(target=lambda i=i: out.setdefault(i, group.submit(i))) for i in range(5)
    ]
    for t in threads:
        t.start()
    _wait_for(lambda: len(group._queue) == 5)
    rec.release.set()
    leader.join(30)
    _joined(threads, out)
    assert out == {i: ("written", i) for i in range(5)}
    assert [len(b) for b in rec.batches] == [1, 2, 2, 1]


def test_a_write_the_batch_left_unsettled_is_an_error_not_a_silent_success() -> None:
    group = GroupCommit(lambda batch: None)
    with pytest.raises(RuntimeError, match="without a result"):
        group.submit("x")
