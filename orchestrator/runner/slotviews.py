"""The supervisor's slots and what the driver reads of them (``SlotBook``, which the
supervisor holds as ``book``): the nodes that are up, a weight broadcast's members, the failed
slots, the wait for capacity, the states. The book owns the slots' lock; each view takes it."""

from __future__ import annotations

import threading
import time
from typing import Any

from rollcall.orchestrator.buffer.control import ControlPlaneBuffer
from rollcall.orchestrator.runner.slots import Slot


class SlotBook:
    """The rollout slots, their lock and the time since when none is up or starting; the
    supervisor changes them under ``lock``, the views below read them."""

    def __init__(self, buffer: ControlPlaneBuffer, slots: list[Slot]) -> None:
        self.buffer = buffer
        self.slots = slots
        self.lock = threading.Lock()
        self.waiting_since: float | None = None  # no slot up or starting since then

    @property
    def actors(self) -> list[Any]:
        """The nodes that are up: started and registered (a node still starting would answer
        a call only once its constructor finished)."""
        with self.lock:
            return [s.actor for s in self.slots if s.actor is not None and s.up]

    def named_actors(self) -> list[tuple[str, Any]]:
        """(name, actor) of the nodes that are up."""
        with self.lock:
            return [(s.name, s.actor) for s in self.slots if s.actor is not None and s.up]

    def members(self) -> list[tuple[str, Any]]:
        """(name, actor) of the nodes a weight broadcast goes to: up here, and alive in the
        database as the slot's current incarnation (a membership epoch's members)."""
        health = {w["name"]: w for w in self.buffer.node_health()}
        with self.lock:
            return [
                (s.name, s.actor)
                for s in self.slots
                if s.actor is not None
                and s.up
                and s.state == "alive"
                and s.worker_id is not None
                and health.get(s.name, {}).get("id") == s.worker_id
                and health[s.name]["status"] == "alive"
            ]

    @property
    def all_failed(self) -> bool:
        """Every slot is over its restart budget: the job has no rollout node left."""
        with self.lock:
            live = [s for s in self.slots if s.state != "removed"]
            return bool(live) and all(s.failed for s in live)

    def failures(self) -> list[str]:
        """Why each failed slot failed (its last reason)."""
        with self.lock:
            return [
                f"{s.name}: {s.history[-1]['reason']}" for s in self.slots if s.failed and s.history
            ]

    def waiting_for_capacity(self) -> float | None:
        """Seconds since no slot has been up, starting or able to start (every one waits for
        a machine, or for Ray's word on its lost one), or None."""
        with self.lock:
            if self.waiting_since is None:
                return None
            return time.monotonic() - self.waiting_since

    def states(self) -> dict[str, int]:
        with self.lock:
            out: dict[str, int] = {}
            for s in self.slots:
                out[s.state] = out.get(s.state, 0) + 1
            return out
