"""The rollout nodes' supervisor: restarts dead nodes with exponential backoff and a budget.

A node is down when its actor died (its ``run`` call failed: SIGKILL, lost Ray node, an engine
failure or a tripped breaker raised by the node), when it stopped because the database declared
it dead, or when the database declared it dead while the actor still exists (a hang: SIGSTOP,
a deadlocked engine). The supervisor kills what is left of it, makes sure its leases are
requeued (the next claimer resumes from the checkpoints), and starts a new incarnation of the
same slot after ``backoff_base_s * 2^(restarts-1)`` seconds (capped).

A start has two stages, each with its own bound. The actor's process must come up and register
its worker row (``starting``) within ``start_timeout_s``; from then on it beats while its
engine loads, and a node that beats is starting, not dead, until ``engine_start_timeout_s``.
A start that fails (the constructor raised, a bound passed, declared dead while starting)
counts against the budget like any other death. Only Ray's structured word that the machine
is gone (``NodeDiedError``, a preempted actor, or the node the worker registered from no
longer alive in Ray's node table) does not count: that is not the slot's fault. A slot that
needs more than ``max_restarts`` restarts within ``restart_window_s`` is marked failed, with a
``worker.failed`` event; the job goes on with the other nodes, and ``all_failed`` tells the
driver when none is left. Recovery goes through the normal path: the new actor registers a
new worker incarnation and takes work from the buffer like any node.

The driver runs ``check()`` as a scheduler job, on its own thread, so supervision never waits
on the trainer or the driver's loop; a lock keeps ``check()``, ``actors`` and ``stop()``
apart, and once ``stop()`` ran, ``check()`` starts nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orchestrator.buffer.service import Buffer
from orchestrator.domain import WorkerStatus

log = logging.getLogger(__name__)


@dataclass
class Slot:
    name: str
    index: int
    actor: Any = None
    run_ref: Any = None
    worker_ref: Any = None
    worker_id: int | None = None
    prev_worker_id: int | None = None  # the slot's latest incarnation before this start
    node_id: str | None = None  # the Ray node the incarnation registered from
    up: bool = False  # its constructor finished: the engine is up
    registered_at: float = 0.0
    restarts: int = 0
    started_at: float = 0.0
    next_start_at: float = 0.0
    failed: bool = False
    history: list[dict[str, Any]] = field(default_factory=list)


class Supervisor:
    def __init__(
        self,
        buffer: Buffer,
        start_node: Callable[[int], Any],
        *,
        nodes: int,
        max_restarts: int,
        restart_window_s: float = 600.0,
        backoff_base_s: float = 1.0,
        backoff_cap_s: float = 30.0,
        start_timeout_s: float = 120.0,
        engine_start_timeout_s: float = 900.0,
        say: Callable[[str], None] = log.info,
    ) -> None:
        self.buffer = buffer
        self.start_node = start_node
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        self.start_timeout_s = start_timeout_s
        self.engine_start_timeout_s = engine_start_timeout_s
        self.say = say
        self.slots = [Slot(f"rollout-{i}", i) for i in range(nodes)]
        self._lock = threading.Lock()
        self._stopped = False
        self.final_reports: list[dict[str, Any]] = []  # what the stopped nodes' runs returned
        for slot in self.slots:
            self._start(slot)

    @property
    def actors(self) -> list[Any]:
        """The nodes that are up: started and registered (a node still starting would answer
        a call only once its constructor finished)."""
        with self._lock:
            return [s.actor for s in self.slots if s.actor is not None and s.up]

    def named_actors(self) -> list[tuple[str, Any]]:
        """(name, actor) of the nodes that are up."""
        with self._lock:
            return [(s.name, s.actor) for s in self.slots if s.actor is not None and s.up]

    def members(self) -> list[tuple[str, Any]]:
        """(name, actor) of the nodes a weight broadcast goes to: up here, and alive in the
        database as the slot's current incarnation (a membership epoch's members)."""
        health = {w["name"]: w for w in self.buffer.node_health()}
        with self._lock:
            return [
                (s.name, s.actor)
                for s in self.slots
                if s.actor is not None
                and s.up
                and s.worker_id is not None
                and health.get(s.name, {}).get("id") == s.worker_id
                and health[s.name]["status"] == "alive"
            ]

    @property
    def all_failed(self) -> bool:
        """Every slot is over its restart budget: the job has no rollout node left."""
        with self._lock:
            return all(s.failed for s in self.slots)

    def failures(self) -> list[str]:
        """Why each failed slot failed (its last reason)."""
        with self._lock:
            return [
                f"{s.name}: {s.history[-1]['reason']}" for s in self.slots if s.failed and s.history
            ]

    def _start(self, slot: Slot) -> None:
        latest = {w["name"]: w["id"] for w in self.buffer.node_health()}
        slot.prev_worker_id = latest.get(slot.name)
        slot.actor = self.start_node(slot.index)
        slot.run_ref = slot.actor.run.remote()
        slot.worker_ref = slot.actor.worker_id.remote()
        slot.worker_id = None
        slot.node_id = None
        slot.up = False
        slot.started_at = time.monotonic()

    def check(self) -> None:
        """One supervision pass: detect down nodes, restart those whose backoff has passed."""
        with self._lock:
            if not self._stopped:
                self._check()

    def _check(self) -> None:
        import ray

        health = {w["name"]: w for w in self.buffer.node_health()}  # latest incarnations
        now = time.monotonic()
        for slot in self.slots:
            if slot.failed:
                continue
            if slot.actor is None:
                if now >= slot.next_start_at:
                    self._start(slot)
                    self.say(f"{slot.name}: restarted (restart {slot.restarts})")
                continue
            row = health.get(slot.name)
            if slot.worker_id is None and row is not None and row["id"] != slot.prev_worker_id:
                slot.worker_id = int(row["id"])  # registered: its process is up, engine loading
                slot.node_id = row.get("node_id")
                slot.registered_at = now
            if not slot.up:
                reason = self._starting(slot, row, now)
                if reason is not None:
                    self._down(slot, *reason)
                continue
            reason_text = None
            lost_machine = False
            declared = _declared_dead(row, slot.worker_id)
            ready, _ = ray.wait([slot.run_ref], timeout=0)
            if ready:
                try:
                    ray.get(slot.run_ref)
                    reason_text = f"stopped ({declared or 'declared dead by the control plane'})"
                except Exception as e:
                    reason_text = _death_reason(e)
                    lost_machine = _machine_lost(e, slot.node_id)
            elif declared is not None:
                reason_text = declared
            if reason_text is not None:
                self._down(slot, reason_text, lost_machine)

    def _starting(
        self, slot: Slot, row: dict[str, Any] | None, now: float
    ) -> tuple[str, bool] | None:
        """A start in progress: None while it may go on, else (why it failed, machine lost)."""
        import ray

        ready, _ = ray.wait([slot.worker_ref], timeout=0)
        if ready:
            try:
                slot.worker_id = int(ray.get(slot.worker_ref))
            except Exception as e:  # the constructor failed (a bad model path, an engine error)
                return f"failed to start: {_death_reason(e)}", _machine_lost(e, slot.node_id)
            slot.up = True
            return None
        if slot.worker_id is None:  # the process has not registered yet
            if now - slot.started_at > self.start_timeout_s:
                return (
                    f"did not start within {self.start_timeout_s:.0f} s (not placed, or its "
                    "process never registered)",
                    False,
                )
            return None
        status = row["status"] if row is not None and row["id"] == slot.worker_id else None
        if status in ("dead", "failed"):
            return "declared dead while starting (its heartbeats stopped)", False
        if now - slot.registered_at > self.engine_start_timeout_s:
            return f"engine not up within {self.engine_start_timeout_s:.0f} s", False
        return None  # beating while its engine loads: starting, not dead

    def _down(self, slot: Slot, reason: str, lost_machine: bool = False) -> None:
        """``lost_machine``: Ray reports the actor's node gone. That is not the slot's fault and
        does not count against its budget: until Ray notices the node is dead (its health
        check), a restart may be placed on it again and fail the same way."""
        import ray

        with contextlib.suppress(Exception):  # already gone
            ray.kill(slot.actor, no_restart=True)
        if slot.worker_id is not None:
            # Requeue now rather than wait for the sweep (idempotent when it already ran).
            self.buffer.requeue_worker(slot.worker_id, WorkerStatus.DEAD)
        slot.actor = slot.run_ref = slot.worker_ref = None
        slot.up = False
        now = time.monotonic()
        slot.history.append(
            {"at": now, "reason": reason, "worker_id": slot.worker_id, "counted": not lost_machine}
        )
        # the budget counts the restarts of the last restart_window_s: a node that has been
        # healthy for a while gets its budget back
        recent = [h for h in slot.history if now - h["at"] <= self.restart_window_s]
        slot.restarts = sum(1 for h in recent if h["counted"])
        if slot.restarts > self.max_restarts:
            slot.failed = True
            if slot.worker_id is not None:
                self.buffer.requeue_worker(slot.worker_id, WorkerStatus.FAILED)
            self.buffer.event(
                "worker.failed",
                f"{slot.name} failed: down {slot.restarts} times, over its budget of "
                f"{self.max_restarts} restarts; the job continues without it ({reason})",
                {"slot": slot.name, "restarts": slot.restarts, "reason": reason},
            )
            self.say(
                f"{slot.name}: FAILED: down {slot.restarts} times within "
                f"{self.restart_window_s:.0f} s, over its budget of {self.max_restarts} restarts "
                f"({reason}); the job continues without it"
            )
            return
        delay = min(self.backoff_cap_s, self.backoff_base_s * 2 ** (len(recent) - 1))
        slot.next_start_at = time.monotonic() + delay
        self.buffer.event(
            "worker.restarting",
            f"{slot.name} down ({reason}); restart {slot.restarts}/{self.max_restarts} "
            f"in {delay:.1f} s",
            {"slot": slot.name, "restarts": slot.restarts, "reason": reason, "delay_s": delay},
        )
        self.say(f"{slot.name}: down ({reason}); restarting in {delay:.1f} s")

    def stop(self) -> list[int]:
        """Stop every node (``run`` returns after its current episodes); returns their worker
        ids for the final requeue."""
        with self._lock:
            self._stopped = True
            return self._stop()

    def _stop(self) -> list[int]:
        import ray

        live = [s for s in self.slots if s.actor is not None]
        for s in live:
            s.actor.stop.remote()
        runs = [s.run_ref for s in live]
        if runs:
            ready, _ = ray.wait(runs, num_returns=len(runs), timeout=60.0)
            for ref in ready:  # a run that ended returns the node's final report
                with contextlib.suppress(Exception):  # it ended with an error: no report
                    self.final_reports.append(ray.get(ref, timeout=0))
        ids = []
        for s in live:
            if s.worker_id is None:
                try:
                    s.worker_id = int(ray.get(s.worker_ref, timeout=5))
                except Exception:
                    s.worker_id = None
            if s.worker_id is not None:
                ids.append(s.worker_id)
            ray.kill(s.actor, no_restart=True)
            s.actor = None
        return ids


def _declared_dead(row: dict[str, Any] | None, worker_id: int | None) -> str | None:
    """Why the database says the slot's incarnation is dead (None: it does not): the words the
    row keeps (the sweep's, "declared dead by the control plane (no heartbeat ...)", or the
    node's own when it gave up before its run returned: its breaker tripped, its engine
    failed), never a guess."""
    if row is None or row["id"] != worker_id or row["status"] not in ("dead", "failed"):
        return None
    return str(row.get("status_reason") or "declared dead by the control plane")


def _death_reason(e: BaseException) -> str:
    """What ended a node's ``run``: the exception the node raised (an ``EngineFailure``, say),
    or the kind of actor death Ray reports."""
    import ray.exceptions

    if isinstance(e, ray.exceptions.RayTaskError):
        cause = e.cause if isinstance(e.cause, BaseException) else e
        first = str(cause).strip().splitlines()[0][:300] if str(cause).strip() else ""
        return f"{type(cause).__name__}: {first}" if first else type(cause).__name__
    if isinstance(e, ray.exceptions.RayActorError) and e.actor_init_failed:
        # its constructor raised: Ray's text of it ends with the exception's own line
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        return f"constructor raised {lines[-1][:300]}" if lines else "constructor raised"
    return f"actor died ({type(e).__name__})"


def _machine_lost(e: BaseException, node_id: str | None = None) -> bool:
    """Whether Ray says the actor's machine is gone (rather than the actor failing by itself),
    from its structured errors only, never from message text: ``NodeDiedError``; an actor
    death Ray marks preempted; or, for an actor that died by itself (not in its constructor),
    the Ray node it registered from (``node_id``) no longer alive in Ray's node table."""
    import ray.exceptions

    if isinstance(e, ray.exceptions.NodeDiedError):
        return True
    if isinstance(e, ray.exceptions.RayTaskError):  # the node's own code raised: its failure
        return False
    if isinstance(e, ray.exceptions.RayActorError):
        if e.actor_init_failed:  # its constructor raised
            return False
        if e.preempted:
            return True
        return node_id is not None and not _ray_node_alive(node_id)
    return False


def _ray_node_alive(node_id: str) -> bool:
    import ray

    try:
        nodes = ray.nodes()
    except Exception:  # Ray's control store is away: no structured answer, count it
        return True
    for n in nodes:
        if n.get("NodeID") == node_id:
            return bool(n.get("Alive"))
    return True  # not in the table: no structured answer, count it
