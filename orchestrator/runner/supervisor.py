"""The rollout nodes' supervisor: one slot per rollout node, restarted with backoff within a
budget that only the node's own failures spend, placed where Ray has room, and a fleet that
grows, shrinks and moves off draining machines under a running job.

A slot is in one state (``rollout_slots.state``, shown by ``rollcall status`` and
``rollcall worker list``):

- ``waiting_capacity``: its placement group (``orchestrator/runner/placement.py``, one bundle
  per slot) is not placed on a live machine (no machine has room: lost, never there, or the
  slot is new). It starts as soon as Ray places it (a machine joined, another job ended),
  with one line when it starts waiting and one when it is placed. Never counted.
- ``starting``, ``alive``: an incarnation is up or coming up. A start has two bounds: its
  process registers (``starting``) within ``start_timeout_s``, then its engine is up within
  ``engine_start_timeout_s`` while it beats.
- ``awaiting_ray``: it died in a way that its machine's loss explains too (its actor became
  unreachable, it stopped beating, it did not register): the restart waits for Ray's word on
  the machine (``orchestrator/runner/raynodes.py``): the node marked dead, or the actor
  recorded dead with it, is a lost machine (not counted, and the slot waits for Ray to place
  its group elsewhere); a probe the machine answers, or ``machine_verdict_s`` without a word,
  makes it the node's own death. So a restart never goes into a bundle on a dying machine.
- ``restarting``: down by its own failure (its code raised: an ``EngineFailure``, a tripped
  breaker, a constructor that raised; or its machine proved alive), counted, restarted after
  ``backoff_base_s * 2^(n-1)`` seconds (capped), n its deaths in a row each within
  ``HEALTHY_RESET_S`` of its start (an incarnation that ran longer starts n over at 1).
- ``draining``: its machine is being drained (Ray's draining state: ``rollcall node drain``,
  ``ray drain-node``, an autoscaler) or the fleet shrinks (``rollcall job scale``): the node
  finishes its in-flight turns, checkpoints them and gives its leases back (``drain()``),
  within ``drain_timeout_s``; then the slot gets a new placement group (Ray places nothing new
  on a draining machine) or is removed.
- ``failed``: more than ``max_restarts`` counted restarts within ``restart_window_s``; the job
  goes on with the other slots (``all_failed`` when none is left). ``removed``: scaled away.

Whatever ends an incarnation, its leases are requeued at once (the next claimer resumes from
the checkpoints). The driver runs ``check()`` as a scheduler job, on its own thread, so
supervision never waits on the trainer or the driver's loop; a lock keeps ``check()``,
``actors`` and ``stop()`` apart, and once ``stop()`` ran, ``check()`` starts nothing.

A slot, and how a death is judged (the node's own, its machine's, or unknown until Ray says):
``orchestrator/runner/slots.py``; slots added, removed and drained: ``orchestrator/runner/
fleet.py``; the views the driver reads (``actors``, ``members``, ...):
``orchestrator/runner/slotviews.py``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from rollcall.orchestrator.buffer.control import ControlPlaneBuffer
from rollcall.orchestrator.domain import WorkerStatus
from rollcall.orchestrator.runner import raynodes
from rollcall.orchestrator.runner.fleet import RESCHEDULE_GRACE_S, Fleet
from rollcall.orchestrator.runner.placement import group_state, strategy
from rollcall.orchestrator.runner.slots import (
    MACHINE,
    OWN,
    UNKNOWN,
    Slot,
    _death_reason,
    _declared_dead,
    _evidence,
    _judge_error,
    _ray_node_alive,
)
from rollcall.orchestrator.runner.slotviews import SlotBook

log = logging.getLogger(__name__)

# An incarnation that ran this long before it died was healthy: its restart's backoff starts
# over from restart_backoff_s (the budget still counts it). Shorter lives in a row are a crash
# loop, and the backoff doubles with each.
HEALTHY_RESET_S = 60.0
ACTIVE = ("starting", "alive", "restarting", "awaiting_ray", "waiting_capacity", "draining")


class Supervisor:
    def __init__(
        self,
        buffer: ControlPlaneBuffer,
        start_node: Callable[..., Any],
        *,
        nodes: int,
        max_restarts: int,
        restart_window_s: float = 600.0,
        backoff_base_s: float = 1.0,
        backoff_cap_s: float = 30.0,
        start_timeout_s: float = 120.0,
        engine_start_timeout_s: float = 900.0,
        machine_verdict_s: float = 60.0,
        drain_timeout_s: float = 120.0,
        placement: Any = None,
        say: Callable[[str], None] = log.info,
    ) -> None:
        """``start_node(index, strategy)`` creates slot ``index``'s actor (``strategy``: where
        Ray places it, its placement group's bundle; None without ``placement``).
        ``placement``: the job's ``Reservation`` (its ``slots`` are the first ``nodes``
        slots' groups, placed); None: no reservation (tests), nodes go wherever Ray puts them
        and the fleet does not change."""
        self.buffer = buffer
        self.start_node = start_node
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        self.start_timeout_s = start_timeout_s
        self.engine_start_timeout_s = engine_start_timeout_s
        self.machine_verdict_s = machine_verdict_s
        self.drain_timeout_s = drain_timeout_s
        self.placement = placement
        self.say = say
        self._sandbox_lines: set[str] = set()  # what tool calls get, as nodes said it
        self._stopped = False
        self.final_reports: list[dict[str, Any]] = []  # what the stopped nodes' runs returned
        self._nodes: dict[str, dict[str, Any]] | None = None  # Ray's node table, this pass
        groups = list(placement.slots) if placement is not None else []
        self.slots = [Slot(f"rollout-{i}", i) for i in range(nodes)]
        # the slots, their lock and the views the driver reads (the same list, never rebound)
        self.book = SlotBook(buffer, self.slots)
        self._lock = self.book.lock
        for slot, group in zip(self.slots, groups, strict=False):
            slot.group = group
        self._nodes = raynodes.nodes() if placement is not None else None
        self.fleet = Fleet(self)
        for slot in self.slots:
            self.place(slot, time.monotonic())

    # -- a pass -------------------------------------------------------------------------------

    def check(self) -> None:
        """One supervision pass: the fleet's size, draining machines, down nodes, verdicts,
        placements and restarts."""
        with self._lock:
            if not self._stopped:
                self._check()

    def _check(self) -> None:
        now = time.monotonic()
        if self.placement is not None:
            self._nodes = raynodes.nodes()
            self.fleet.resize(now)
            draining = raynodes.draining()
        else:
            draining = set()
        health = {w["name"]: w for w in self.buffer.node_health()}  # latest incarnations
        for slot in self.slots:
            if slot.state in ("failed", "removed"):
                continue
            try:
                if slot.down is not None:  # a death not judged yet (its event failed)
                    self._judge_down(slot)
                elif slot.state == "draining":
                    self.fleet.drained(slot, now)
                elif slot.state == "awaiting_ray":
                    self._judge(slot, now)
                elif slot.state in ("waiting_capacity", "restarting"):
                    if now >= slot.next_start_at:
                        self.place(slot, now, draining)
                else:
                    self._watch(slot, health.get(slot.name), now, draining)
            except Exception:  # the database or Ray's GCS away: the next pass tries again
                log.warning("supervising %s failed; trying again", slot.name, exc_info=True)
        active = [s for s in self.slots if s.state in ACTIVE]
        waiting = bool(active) and all(
            s.state in ("waiting_capacity", "awaiting_ray") for s in active
        )
        if not waiting:
            self.book.waiting_since = None
        elif self.book.waiting_since is None:
            self.book.waiting_since = now

    def _watch(
        self, slot: Slot, row: dict[str, Any] | None, now: float, draining: set[str]
    ) -> None:
        """A starting or alive slot: is its incarnation down, or its machine draining?"""
        import ray

        if slot.worker_id is None and row is not None and row["id"] != slot.prev_worker_id:
            slot.worker_id = int(row["id"])  # registered: its process is up, engine loading
            slot.node_id = row.get("node_id") or slot.node_id
            slot.registered_at = now
        if not slot.up:
            failed = self._starting(slot, row, now)
            if failed is not None:
                reason, judged, evidence = failed
                self._down(slot, reason, judged, start_evidence=evidence)
                return
            if slot.up:
                self.set_state(slot, "alive", None)
                if slot.history or slot.said_waiting:
                    self.say(f"{slot.name}: up on {self._where(slot.node_id)}")
                sandbox = (row or {}).get("tool_sandbox")
                if sandbox and sandbox not in self._sandbox_lines:  # once per distinct line
                    self._sandbox_lines.add(sandbox)
                    self.say(f"{slot.name}: {sandbox}")
        if slot.node_id is not None and slot.node_id in draining:
            self.fleet.drain(slot, now, f"its machine, {self._where(slot.node_id)}, is draining")
            return
        if not slot.up:
            return
        declared = _declared_dead(row, slot.worker_id)
        ready, _ = ray.wait([slot.run_ref], timeout=0)
        if ready:
            try:
                ray.get(slot.run_ref)
                self._down(
                    slot, f"stopped ({declared or 'declared dead by the control plane'})", UNKNOWN
                )
            except Exception as e:
                self._down(slot, _death_reason(e), _judge_error(e, slot))
        elif declared is not None:
            self._down(slot, declared, UNKNOWN)

    def _starting(
        self, slot: Slot, row: dict[str, Any] | None, now: float
    ) -> tuple[str, str, list[str]] | None:
        """A start in progress: None while it may go on, else (why it failed, its judgement,
        the tail of its error: empty where no error came back)."""
        import ray

        ready, _ = ray.wait([slot.worker_ref], timeout=0)
        if ready:
            try:
                slot.worker_id = int(ray.get(slot.worker_ref))
            except Exception as e:  # the constructor failed (a bad model path, an engine error)
                return f"failed to start: {_death_reason(e)}", _judge_error(e, slot), _evidence(e)
            slot.up = True
            return None
        if slot.worker_id is None:  # the process has not registered yet
            if now - slot.started_at > self.start_timeout_s:
                return (
                    f"did not start within {self.start_timeout_s:.0f} s (its process never "
                    "registered)",
                    UNKNOWN,
                    [],
                )
            return None
        status = row["status"] if row is not None and row["id"] == slot.worker_id else None
        if status in ("dead", "failed"):
            return "declared dead while starting (its heartbeats stopped)", UNKNOWN, []
        if now - slot.registered_at > self.engine_start_timeout_s:
            return f"engine not up within {self.engine_start_timeout_s:.0f} s", OWN, []
        return None  # beating while its engine loads: starting, not dead

    # -- deaths and verdicts ------------------------------------------------------------------

    def _down(
        self, slot: Slot, reason: str, judged: str, start_evidence: list[str] | None = None
    ) -> None:
        """An incarnation ended: requeue its leases now, then judge the death.
        ``start_evidence``: it never started (a list, empty without an error to show)."""
        node = slot.node_id
        if judged == UNKNOWN and self.placement is None:
            judged = OWN if node is None or _ray_node_alive(node) else MACHINE
        if judged == UNKNOWN and (node is None or not self._alive(node)):
            judged = MACHINE if node is not None else OWN
        # A lost machine is not the episodes' doing: their attempts are not counted.
        worker_id = slot.worker_id
        self.end_incarnation(slot, counted=judged != MACHINE)
        slot.died_at = time.monotonic()
        # judged below; should that fail (its event not written: the database away past the
        # retries), the next pass judges it again instead of watching an actor that is gone
        slot.down = (reason, judged)
        if start_evidence is not None:
            self._start_failed(slot, worker_id, reason, start_evidence)
        self._judge_down(slot)

    def _judge_down(self, slot: Slot) -> None:
        """What follows a death (``slot.down``): wait for Ray's word on its machine, or
        restart it, counted or not."""
        assert slot.down is not None
        reason, judged = slot.down
        node = slot.node_id
        if judged == UNKNOWN:
            assert node is not None
            slot.verdict = {
                "reason": reason,
                "node": node,
                "probe": raynodes.probe(node),
                "until": time.monotonic() + self.machine_verdict_s,
            }
            self.set_state(slot, "awaiting_ray", reason)
            self.say(
                f"{slot.name}: down ({reason}); waiting for Ray's word on its machine, "
                f"{self._where(node)}, before restarting it"
            )
        elif judged == MACHINE:
            self._lost(slot, reason)
        else:
            self._counted(slot, reason)
        slot.down = None

    def _start_failed(
        self, slot: Slot, worker_id: int | None, reason: str, evidence: list[str]
    ) -> None:
        """A start that failed: a ``worker.start_failed`` event with the tail of its error
        (for vLLM, the root cause its processes wrote), and the tail in driver.log. Best
        effort: the restart goes on without it (its reason names the cause too)."""
        try:
            self.buffer.event(
                "worker.start_failed",
                f"{slot.name} failed to start ({reason})",
                {"slot": slot.name, "worker_id": worker_id, "reason": reason,
                 "evidence": evidence},
            )  # fmt: skip
        except Exception:
            log.warning("could not record %s's failed start", slot.name, exc_info=True)
        if evidence:
            log.warning(
                "%s failed to start (%s); the end of its error:\n%s",
                slot.name, reason, "\n".join(evidence),
            )  # fmt: skip

    def _judge(self, slot: Slot, now: float) -> None:
        """A slot awaiting Ray's word on its machine."""
        v = slot.verdict
        assert v is not None
        if not self._alive(v["node"]):
            self._lost(slot, v["reason"])
        elif raynodes.answered(v["probe"]):
            self._counted(slot, f"{v['reason']}; its machine is alive")
        elif now >= v["until"]:
            self._counted(
                slot,
                f"{v['reason']}; Ray did not say its machine was lost within "
                f"{self.machine_verdict_s:.0f} s",
            )
        else:
            return
        slot.verdict = None

    def _lost(self, slot: Slot, reason: str) -> None:
        """Its machine is gone: not counted; the slot starts again as soon as Ray places its
        group on a live machine (at once where there is room)."""
        node = slot.node_id
        where = self._where(node)
        self.buffer.event(  # first: should it fail, nothing changed and the next pass retries
            "worker.machine_lost",
            f"{slot.name} down with its machine, {where} ({reason}); not counted against its "
            "restart budget",
            {"slot": slot.name, "ray_node_id": node, "reason": reason},
        )
        slot.losses += 1
        slot.history.append(
            {"at": time.monotonic(), "reason": reason, "worker_id": slot.worker_id,
             "counted": False}
        )  # fmt: skip
        self.say(
            f"{slot.name}: its machine, {where}, is lost ({reason}); not counted against its "
            "restart budget; it starts again where Ray has room"
        )
        slot.next_start_at = 0.0
        slot.quiet_until = time.monotonic() + RESCHEDULE_GRACE_S
        self.set_state(slot, "waiting_capacity", f"its machine, {where}, was lost")
        slot.said_waiting = False

    def _counted(self, slot: Slot, reason: str) -> None:
        """The node's own failure: counted against the budget; restarted after a backoff.
        The event goes first: should it fail, nothing changed and the next pass retries."""
        now = time.monotonic()
        death = {"at": now, "reason": reason, "worker_id": slot.worker_id, "counted": True}
        # the budget counts the restarts of the last restart_window_s: a node that has been
        # healthy for a while gets its budget back
        recent = [h for h in [*slot.history, death] if now - h["at"] <= self.restart_window_s]
        restarts = sum(1 for h in recent if h["counted"])
        if restarts > self.max_restarts:
            if slot.worker_id is not None:
                self.buffer.requeue_worker(slot.worker_id, WorkerStatus.FAILED)
            self.buffer.event(
                "worker.failed",
                f"{slot.name} failed: down {restarts} times, over its budget of "
                f"{self.max_restarts} restarts; the job continues without it ({reason})",
                {"slot": slot.name, "restarts": restarts, "reason": reason},
            )
            slot.history.append(death)
            slot.restarts = restarts
            self.say(
                f"{slot.name}: FAILED: down {restarts} times within "
                f"{self.restart_window_s:.0f} s, over its budget of {self.max_restarts} restarts "
                f"({reason}); the job continues without it"
            )
            self.set_state(slot, "failed", reason)
            if self.placement is not None:
                self.placement.drop(slot.group)  # its resources go back to the cluster
            return
        # how long it lived: to its death, not to this verdict (Ray's word may come later)
        lived = max(slot.died_at, slot.started_at) - slot.started_at
        healthy = slot.started_at > 0 and lived >= HEALTHY_RESET_S
        streak = 1 if healthy else slot.streak + 1
        delay = min(self.backoff_cap_s, self.backoff_base_s * 2 ** (streak - 1))
        self.buffer.event(
            "worker.restarting",
            f"{slot.name} down ({reason}); restart {restarts}/{self.max_restarts} in {delay:.1f} s",
            {"slot": slot.name, "restarts": restarts, "reason": reason, "delay_s": delay},
        )
        slot.history.append(death)
        slot.restarts = restarts
        slot.streak = streak
        slot.next_start_at = now + delay
        self.say(
            f"{slot.name}: down ({reason}); restart {slot.restarts}/{self.max_restarts} in "
            f"{delay:.1f} s"
        )
        self.set_state(slot, "restarting", reason)

    def end_incarnation(self, slot: Slot, *, counted: bool) -> None:
        """End the slot's incarnation, whatever ended it: its leases requeued now rather than
        at the sweep (idempotent when it already ran; ``counted``: as an attempt of each
        episode), before the kill, so that should the requeue fail nothing changed and the
        next pass ends it again; then its actor killed and its references dropped."""
        import ray

        if slot.worker_id is not None:
            self.buffer.requeue_worker(slot.worker_id, WorkerStatus.DEAD, counted=counted)
        with contextlib.suppress(Exception):  # already gone
            ray.kill(slot.actor, no_restart=True)
        slot.actor = slot.run_ref = slot.worker_ref = None
        slot.up = False

    # -- placement ----------------------------------------------------------------------------

    def place(self, slot: Slot, now: float, draining: set[str] | None = None) -> None:
        """Start the slot's next incarnation where its group is placed, or wait for room."""
        if self.placement is None:
            self._start(slot, None, None)
            return

        state, node = group_state(slot.group)
        if state == "UNKNOWN":  # Ray's GCS did not answer: no word on capacity, ask again
            return
        if node is not None and node in (draining or set()):
            self.fleet.regroup(slot)  # placed on a draining machine: ask Ray for room elsewhere
            state, node = group_state(slot.group)
        if state == "CREATED" and node is not None and self._alive(node):
            waited = max(0.0, time.monotonic() - slot.since) if slot.said_waiting else 0.0
            if slot.said_waiting:
                self.buffer.event(
                    "worker.placed",
                    f"{slot.name} placed on {self._where(node)} after waiting {waited:.0f} s",
                    {"slot": slot.name, "ray_node_id": node, "waited_s": waited},
                )
                self.say(
                    f"{slot.name}: placed on {self._where(node)} after waiting {waited:.0f} s "
                    "for capacity; starting"
                )
            slot.said_waiting = False
            self._start(slot, strategy(slot.group), node)
            return
        if slot.state != "waiting_capacity":
            self.set_state(slot, "waiting_capacity", "no machine has room for its slot")
        if not slot.said_waiting and now >= slot.quiet_until:
            slot.said_waiting = True
            up = sum(1 for s in self.slots if s.state in ("alive", "starting"))
            going_on = (
                f"the job goes on with {up} rollout node(s)"
                if up
                else "no rollout node runs: the job waits for one (rollout.capacity_wait_s)"
            )
            bundle = ", ".join(f"{v:g} {k}" for k, v in self.placement.bundle.items())
            self.buffer.event(
                "worker.waiting_capacity",
                f"{slot.name} waits for a machine with room for its slot ({bundle})",
                {"slot": slot.name, "bundle": self.placement.bundle},
            )
            self.say(
                f"{slot.name}: waiting for capacity: no Ray node has room for its slot "
                f"({bundle}); {going_on}"
            )

    def _start(self, slot: Slot, placement_strategy: Any, node: str | None) -> None:
        latest = {w["name"]: w["id"] for w in self.buffer.node_health()}
        slot.prev_worker_id = latest.get(slot.name)
        slot.actor = (
            self.start_node(slot.index, placement_strategy)
            if self.placement is not None
            else self.start_node(slot.index)
        )
        slot.run_ref = slot.actor.run.remote()
        slot.worker_ref = slot.actor.worker_id.remote()
        slot.worker_id = None
        slot.node_id = node
        slot.up = False
        slot.started_at = time.monotonic()
        if slot.history and slot.history[-1]["counted"]:
            self.say(f"{slot.name}: restarted (restart {slot.restarts})")
        self.set_state(slot, "starting", None)

    # -- helpers ------------------------------------------------------------------------------

    def _alive(self, node: str) -> bool:
        """Alive in Ray's node table (this pass's); a node Ray cannot tell about counts as
        alive (no structured word that it is gone)."""
        if self._nodes is None:
            return True
        n = self._nodes.get(node)
        return True if n is None else bool(n.get("Alive"))

    def _where(self, node: str | None) -> str:
        return raynodes.host(self._nodes, node)

    def set_state(self, slot: Slot, state: str, reason: str | None) -> None:
        """The slot's state, recorded for operators (a database outage only delays that)."""
        if slot.state != state:
            slot.since = time.monotonic()
        slot.state = state
        slot.reason = reason
        try:
            self.buffer.record_slot(
                slot.name, state=state, reason=reason, ray_node_id=slot.node_id,
                restarts=slot.restarts, max_restarts=self.max_restarts,
                machine_losses=slot.losses,
            )  # fmt: skip
        except Exception:
            log.warning("could not record %s's state %s", slot.name, state, exc_info=True)

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
