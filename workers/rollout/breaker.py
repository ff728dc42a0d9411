"""A rollout node's breaker: the failures that are the node's, not its episodes'.

A node that fails ``breaker_failures`` episodes in a row trips its breaker; a node whose engine
died gives up the same way. Either way it stops claiming, gives back every lease it holds at
once (not counted as attempts), with an event, and ends: its ``run`` raises, so the supervisor
restarts it (a new engine, counted against the slot's budget). After a failure the node itself
is suspect: a second failure in a row is not counted against the episode (a poison input fails
on every node; a broken node fails every input).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from rollcall.orchestrator.buffer.rollout import RolloutBuffer
from rollcall.workers.episode.engine import EngineFailure

log = logging.getLogger(__name__)


class NodeBroken(EngineFailure):
    """The node's breaker tripped: it failed ``breaker_failures`` episodes in a row. The node
    gives its leases back (not counted) and ends; the supervisor restarts it (counted)."""


class Breaker:
    """The streak of failed episodes and why the node ended (``engine_error``, ``broken``),
    under the breaker's own lock. ``halt`` stops the node's claims and wakes its loops."""

    def __init__(
        self,
        name: str,
        failures: int,
        buffer: RolloutBuffer,
        worker_id: int,
        halt: Callable[[], None],
    ) -> None:
        self.name = name
        self.failures = failures
        self.buffer = buffer
        self.worker_id = worker_id
        self.halt = halt
        self._lock = threading.Lock()
        self._streak = 0  # episodes failed in a row
        self.engine_error: str | None = None  # the engine died: the node ends
        self.broken: str | None = None  # the breaker tripped: the node ends

    def succeeded(self) -> None:
        """A sample was committed: the streak starts again."""
        with self._lock:
            self._streak = 0

    def failed(self, error: Exception, counted: bool) -> tuple[bool, str | None]:
        """An episode failed with ``error`` (not explained by the weights): whether the
        failure still counts against the episode (only the first of a streak does), and why
        the breaker trips (None: it does not)."""
        with self._lock:
            self._streak += 1
            streak = self._streak
        # After a failure, the node itself is suspect: a second failure in a row is not
        # counted against the episode (a poison input fails on every node; a broken node
        # fails every input), and ``breaker_failures`` in a row trip the breaker.
        counted = counted and streak == 1
        trip = None
        if streak >= self.failures:
            trip = f"{streak} episodes failed in a row (last: {type(error).__name__}: {error})"
        return counted, trip

    def ended(self) -> EngineFailure | None:
        """What the node's ``run`` raises once its loops ended: its engine died, or its breaker
        tripped; None when neither."""
        if self.engine_error is not None:
            return EngineFailure(f"{self.name}: {self.engine_error}")
        if self.broken is not None:
            return NodeBroken(f"{self.name}: {self.broken}")
        return None

    def engine_died(self, reason: str) -> None:
        """The engine is dead: stop claiming, give back every lease at once (not counted as
        attempts) and end; ``run`` raises so the supervisor restarts the node."""
        self.give_up(reason, broken=False)

    def trip(self, reason: str) -> None:
        self.give_up(reason, broken=True)

    def give_up(self, reason: str, *, broken: bool) -> None:
        """The engine died, or (``broken``) the breaker tripped: stop claiming, give back every
        lease at once (not counted as attempts), with an event, and end: ``run`` raises, so the
        supervisor restarts the node (a new engine, counted against the slot's budget)."""
        with self._lock:
            if self.engine_error is not None or self.broken is not None:
                return
            if broken:
                self.broken = reason
            else:
                self.engine_error = reason
        what = "breaker tripped" if broken else "engine failed"
        log.error("%s: %s (%s); giving back its episodes", self.name, what, reason)
        self.halt()
        kind = "worker.breaker_tripped" if broken else "worker.engine_failed"
        try:
            self.buffer.give_back(self.worker_id, reason, kind)
        except Exception:  # the database is away: the sweep requeues them once it is back
            log.warning("could not give back the leases of a broken node", exc_info=True)
