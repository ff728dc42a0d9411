"""A rollout node's lease book and its heartbeat.

``LeaseBook`` knows which claimed episodes the node's loops work on (by lease: episode and
epoch), which of them it lost (the database no longer lists them as the node's: their work is
abandoned at the next turn), and gives back orphans: leases the database says the node holds
but no loop works on (a claim whose answer was lost after the database committed it; a loop
that died holding one), seen at two beats in a row with no claim begun between them.

``Heartbeat`` is the node's heartbeat thread: liveness, lease renewal and the progress made
since the last beat. It reads counters only: it never waits on the engine, a weight load or an
agent loop, so a slow or busy node keeps beating (a hung one stops making progress instead).
It does not look at the published weights: the upkeep thread does (``upkeep.py``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from rollcall.orchestrator.buffer.rollout import RolloutBuffer
from rollcall.orchestrator.buffer.types import Lease
from rollcall.orchestrator.errors import StaleLeaseError
from rollcall.workers.rollout.enginehost import EngineHost
from rollcall.workers.rollout.stats import Counters

log = logging.getLogger(__name__)

Key = tuple[int, int]  # a lease: (episode id, lease epoch)


class LeaseBook:
    """The node's leases as its loops know them, under the book's own lock (never held
    across I/O)."""

    def __init__(self, buffer: RolloutBuffer, worker_id: int) -> None:
        self.buffer = buffer
        self.worker_id = worker_id
        self._lock = threading.Lock()
        self._active: set[Key] = set()  # episodes the loops work on
        self._lost: set[Key] = set()  # ... whose lease moved on: abandoned at the next turn
        self._unknown: set[Key] = set()  # leases held that no loop works on (at the last beat)
        self._claims_started = 0  # claims begun (orphans are judged between beats' claims)
        self.orphans_released = 0

    def claim_started(self) -> None:
        with self._lock:
            self._claims_started += 1

    def admit(self, key: Key) -> None:
        """A loop works on the episode from here on (the beats renew it and do not orphan it)."""
        with self._lock:
            self._active.add(key)

    def discard(self, key: Key) -> None:
        with self._lock:
            self._active.discard(key)

    def lose(self, key: Key) -> None:
        """The episode's work stops: its lease is taken for gone."""
        with self._lock:
            self._lost.add(key)

    def finish(self, key: Key) -> None:
        """The episode's last sample is done: forgotten."""
        with self._lock:
            self._active.discard(key)
            self._lost.discard(key)

    def is_lost(self, key: Key) -> bool:
        with self._lock:
            return key in self._lost

    def works_on(self, key: Key) -> bool:
        with self._lock:
            return key in self._active

    def idle(self) -> bool:
        """No loop works on any episode."""
        with self._lock:
            return not self._active

    def before_beat(self) -> tuple[set[Key], int]:
        """What the loops work on and the claims begun, as the beat's query starts: only
        episodes admitted before it can be missing from its answer."""
        with self._lock:
            return set(self._active), self._claims_started

    def after_beat(
        self, before: set[Key], held: set[Key], claims: int, claiming: Callable[[], bool]
    ) -> set[Key]:
        """The beat's answer (``held``: the leases the database renewed for the node): the
        episodes worked on since before the beat that it no longer lists are lost; returns the
        orphans to give back. ``claiming``: whether a claim is in flight (it may bring a lease
        not yet admitted)."""
        with self._lock:
            self._lost |= {k for k in before & self._active if k not in held}
            # A lease the database says this node holds but no loop works on (a claim whose
            # answer was lost after the database committed it; a loop that died holding it)
            # is an orphan: seen at two beats in a row with no claim begun between them, it
            # is given back (not counted) instead of being renewed for the node's whole life.
            unknown = {k for k in held if k not in self._active}
            quiet = claims == self._claims_started and not claiming()
            orphans = (unknown & self._unknown) if quiet else set()
            self._unknown = unknown
        return orphans

    def release_orphan(self, episode_id: int, epoch: int) -> None:
        lease = Lease(episode_id, 0, epoch, self.worker_id)
        try:
            self.buffer.release(lease, "orphan lease: the node works on no such episode",
                                counted=False)  # fmt: skip
        except StaleLeaseError:
            return
        except Exception:
            log.warning("could not give back orphan lease %s", episode_id, exc_info=True)
            return
        with self._lock:
            self.orphans_released += 1
        log.warning("gave back orphan lease of episode %s (epoch %s)", episode_id, epoch)


class Heartbeat:
    """The heartbeat thread: beats every ``interval_s`` until ``stop`` is set. ``claiming``
    says whether a claim is in flight; ``on_dead`` is called when the node was declared dead
    (it must stop; a new incarnation takes its place)."""

    def __init__(
        self,
        buffer: RolloutBuffer,
        worker_id: int,
        interval_s: float,
        leases: LeaseBook,
        counters: Counters,
        host: EngineHost,
        *,
        claiming: Callable[[], bool],
        on_dead: Callable[[], None],
        stop: threading.Event,
    ) -> None:
        self.buffer = buffer
        self.worker_id = worker_id
        self.interval_s = interval_s
        self.leases = leases
        self.counters = counters
        self.host = host
        self.claiming = claiming
        self.on_dead = on_dead
        self.stop = stop
        self._reported_progress = 0
        self._reported_tokens = 0
        self.thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def beat(self) -> None:
        """One heartbeat: liveness, lease renewal and the progress made since the last beat.
        It reads counters only: it never waits on the engine, a weight load or an agent loop,
        so a slow or busy node keeps beating (a hung one stops making progress instead)."""
        engine = self.host.built()
        tokens = engine.health().tokens_generated if engine is not None else 0
        version = engine.version if engine is not None else None
        before, claims = self.leases.before_beat()
        progress = self.counters.progress()
        alive, leases = self.buffer.beat(
            self.worker_id,
            tokens - self._reported_tokens,
            loaded_version=version,
            progress=progress != self._reported_progress,
        )
        self._reported_tokens = tokens
        self._reported_progress = progress
        orphans = self.leases.after_beat(before, set(leases), claims, self.claiming)
        for episode_id, epoch in sorted(orphans):
            self.leases.release_orphan(episode_id, epoch)
        if not alive:  # declared dead (e.g. after a hang): stop; a new incarnation takes over
            log.warning("worker %s was declared dead; stopping", self.worker_id)
            self.on_dead()

    def _run(self) -> None:
        """The heartbeat thread: beats only (see ``beat``)."""
        while not self.stop.wait(self.interval_s):
            try:
                self.beat()
            except Exception:  # a missed beat is survivable; the lease budget covers it
                log.exception("heartbeat failed")
