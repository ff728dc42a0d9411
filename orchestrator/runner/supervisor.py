"""The rollout nodes' supervisor: restarts dead nodes with exponential backoff and a budget.

A node is down when its actor died (its ``run`` call failed: SIGKILL, lost Ray node), when it
stopped because the database declared it dead, or when the database declared it dead while the
actor still exists (a hang: SIGSTOP, a deadlocked engine). The supervisor kills what is left of
it, makes sure its leases are requeued (the next claimer resumes from the checkpoints), and
starts a new incarnation of the same slot after ``backoff_base_s * 2^(restarts-1)`` seconds
(capped). A slot that needs more than ``max_restarts`` restarts within ``restart_window_s``
is marked failed, with an event; the job goes on with the other nodes. Recovery goes through
the normal path: the new actor registers a new worker incarnation and takes work from the
buffer like any node.

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
        say: Callable[[str], None] = log.info,
    ) -> None:
        self.buffer = buffer
        self.start_node = start_node
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        self.start_timeout_s = start_timeout_s
        self.say = say
        self.slots = [Slot(f"rollout-{i}", i) for i in range(nodes)]
        self._lock = threading.Lock()
        self._stopped = False
        for slot in self.slots:
            self._start(slot)

    @property
    def actors(self) -> list[Any]:
        """The nodes that are up: started and registered (a node still starting would answer
        a call only once its constructor finished)."""
        with self._lock:
            return [s.actor for s in self.slots if s.actor is not None and s.worker_id is not None]

    def _start(self, slot: Slot) -> None:
        slot.actor = self.start_node(slot.index)
        slot.run_ref = slot.actor.run.remote()
        slot.worker_ref = slot.actor.worker_id.remote()
        slot.worker_id = None
        slot.started_at = time.monotonic()

    def check(self) -> None:
        """One supervision pass: detect down nodes, restart those whose backoff has passed."""
        with self._lock:
            if not self._stopped:
                self._check()

    def _check(self) -> None:
        import ray

        health = {w["id"]: w["status"] for w in self.buffer.node_health()}
        now = time.monotonic()
        for slot in self.slots:
            if slot.failed:
                continue
            if slot.actor is None:
                if now >= slot.next_start_at:
                    self._start(slot)
                    self.say(f"{slot.name}: restarted (restart {slot.restarts})")
                continue
            if slot.worker_id is None:
                ready, _ = ray.wait([slot.worker_ref], timeout=0)
                if ready:
                    try:
                        slot.worker_id = int(ray.get(slot.worker_ref))
                    except Exception as e:  # the constructor failed: the node is down
                        self._down(
                            slot, f"failed to start: {type(e).__name__}: {e}", _machine_lost(e)
                        )
                        continue
                elif now - slot.started_at > self.start_timeout_s:
                    # never came up: e.g. placed on a machine that died before Ray noticed
                    self._down(slot, f"did not start within {self.start_timeout_s:.0f} s", True)
                    continue
            reason = None
            lost_machine = False
            ready, _ = ray.wait([slot.run_ref], timeout=0)
            if ready:
                try:
                    ray.get(slot.run_ref)
                    reason = "stopped (declared dead by the control plane)"
                except Exception as e:
                    reason = _death_reason(e)
                    lost_machine = _machine_lost(e)
            elif slot.worker_id is not None and health.get(slot.worker_id) in ("dead", "failed"):
                reason = "declared dead by the control plane (hung)"
            if reason is not None:
                self._down(slot, reason, lost_machine)

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
            self.say(f"{slot.name}: FAILED after {slot.restarts} restarts ({reason})")
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
            ray.wait(runs, num_returns=len(runs), timeout=60.0)
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


def _death_reason(e: BaseException) -> str:
    """What ended a node's ``run``: the exception the node raised (an ``EngineFailure``, say),
    or the kind of actor death Ray reports."""
    import ray.exceptions

    if isinstance(e, ray.exceptions.RayTaskError):
        cause = e.cause if isinstance(e.cause, BaseException) else e
        first = str(cause).strip().splitlines()[0][:300] if str(cause).strip() else ""
        return f"{type(cause).__name__}: {first}" if first else type(cause).__name__
    return f"actor died ({type(e).__name__})"


def _machine_lost(e: BaseException) -> bool:
    """Whether Ray says the actor's node is gone (rather than the actor failing by itself)."""
    import ray.exceptions

    if isinstance(e, ray.exceptions.NodeDiedError):
        return True
    if isinstance(e, ray.exceptions.RayTaskError):  # the node's own code raised: its failure
        return False
    text = str(e).lower()
    return "node" in text and ("terminated" in text or "died" in text or "dead" in text)
