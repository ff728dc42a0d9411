"""Group commit: the writes a node's agent loops make at the same time go in one transaction.

A rollout node's loops checkpoint every turn and commit every finished sample, each from its
own thread. A write is handed to a ``GroupCommit`` and its caller blocks until the write's
transaction has committed: what the agent loop is told is durable, as with a transaction of its
own. The first caller that finds no transaction in progress becomes the leader: it takes every
write waiting at that moment (its own among them) and runs them through ``write_batch`` in one
transaction; the callers that arrive meanwhile wait and form the next batch. With one loop
writing, a batch is one write and it costs what it did alone; with many, one commit (one WAL
flush, one round trip, one connection) serves them all, and a node's samples of one episode
take its lease lock once per transaction rather than once each.

``write_batch`` sets each write's result. When it raises, every write of the batch gets the
exception (a transient one: each caller's own retry sends its write again, in a later batch).
The leader's thread does the batch's work, so the cost of the database calls shows in the
leader's timed operation, as it did when each write was its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class Pending:
    """One write waiting for its batch: what to write (``item``) and, once written, its
    ``result`` or ``error``."""

    item: Any
    result: Any = None
    error: BaseException | None = None
    done: bool = False

    def settle(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error, self.done = result, error, True


class GroupCommit:
    """Batches concurrent writes into one transaction each (see the module's docstring).

    ``write_batch(pendings)`` writes them all in one transaction and settles each; a
    pending it leaves unsettled is settled with an error. ``batches`` and ``writes`` count
    what was written (their ratio is the mean batch)."""

    def __init__(self, write_batch: Callable[[list[Pending]], None], max_batch: int = 256):
        self._write_batch = write_batch
        self._max_batch = max_batch
        self._cv = threading.Condition()
        self._queue: list[Pending] = []
        self._writing = False
        self.batches = 0
        self.writes = 0

    def submit(self, item: Any) -> Any:
        """Write ``item`` with whatever else is waiting; returns its result once its batch
        committed, or raises the batch's error."""
        me = Pending(item)
        with self._cv:
            self._queue.append(me)
            while self._writing and not me.done:
                self._cv.wait()
            if me.done:
                return _outcome(me)
            # No batch is being written and this write is in none: it leads the next one.
            self._writing = True
            self._queue.remove(me)
            batch = [me, *self._queue[: self._max_batch - 1]]
            del self._queue[: self._max_batch - 1]
        try:
            self._lead(batch)
        finally:
            with self._cv:
                self._writing = False
                self.batches += 1
                self.writes += len(batch)
                self._cv.notify_all()
        return _outcome(me)

    def _lead(self, batch: list[Pending]) -> None:
        try:
            self._write_batch(batch)
        except BaseException as e:  # every write of the batch fails with it; the leader too
            for p in batch:
                if not p.done:
                    p.settle(error=e)
            return
        for p in batch:
            if not p.done:
                p.settle(error=RuntimeError("the batch left this write without a result"))


def _outcome(p: Pending) -> Any:
    if p.error is not None:
        raise p.error
    return p.result
