"""The supervisor's elastic fleet: slots added and removed as the job is scaled
(``rollcall job scale``), and slots moved off machines Ray is draining (``rollcall node
drain``, ``ray drain-node``, an autoscaler). A draining slot's node finishes its in-flight
turns, checkpoints them and gives its leases back (``drain()``) within ``drain_timeout_s``;
then the slot gets a new placement group (Ray places nothing new on a draining machine) or is
removed. Runs inside the supervisor's pass, under its lock (``orchestrator/runner/
supervisor.py``).
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

from rollcall.orchestrator.runner.slots import Slot

if TYPE_CHECKING:
    from rollcall.orchestrator.runner.supervisor import Supervisor

# Ray places a new placement group, or a lost machine's groups elsewhere, within moments where
# there is room: a slot says it waits for capacity only once that has had time
RESCHEDULE_GRACE_S = 5.0


class Fleet:
    def __init__(self, supervisor: Supervisor) -> None:
        self.sup = supervisor

    def regroup(self, slot: Slot) -> None:
        """A new placement group for the slot (the old one's machine is draining)."""
        assert self.sup.placement is not None
        old = slot.group
        slot.group = self.sup.placement.new_slot(slot.name)  # first: should it fail, keep the old
        self.sup.placement.drop(old)
        slot.quiet_until = time.monotonic() + RESCHEDULE_GRACE_S

    def resize(self, now: float) -> None:
        """Match the fleet to the size the job should have (``rollcall job scale``). A failed
        slot still counts (it is not replaced: the job goes on without it, and stops when
        every slot failed); shrinking removes failed slots first, then the highest-numbered."""
        target = self.sup.buffer.fleet_size()
        if target is None:
            return
        live = [s for s in self.sup.slots if s.state != "removed" and not s.remove]
        for _ in range(target - len(live)):
            slot = Slot(f"rollout-{len(self.sup.slots)}", len(self.sup.slots))
            assert self.sup.placement is not None
            slot.group = self.sup.placement.new_slot(slot.name)
            slot.quiet_until = time.monotonic() + RESCHEDULE_GRACE_S
            self.sup.slots.append(slot)
            self.sup.set_state(slot, "waiting_capacity", "added: waits for Ray to place it")
            self.sup.buffer.event(
                "worker.added",
                f"{slot.name} added: the job scaled to {target} rollout nodes",
                {"slot": slot.name, "target": target},
            )
            self.sup.say(f"{slot.name}: added (the job scaled to {target} rollout nodes)")
            self.sup.place(slot, now)
        extra = len(live) - target
        order = sorted(live, key=lambda s: (not s.failed, -s.index))
        for slot in order[: max(0, extra)]:
            slot.remove = True
            if slot.failed:
                self.removed(slot)
                continue
            self.sup.say(f"{slot.name}: removing it (the job scaled to {target} rollout nodes)")
            if slot.state in ("alive", "starting"):
                self.drain(slot, now, f"the job scaled to {target} rollout nodes")
            elif slot.state != "draining":
                self.removed(slot)

    def drain(self, slot: Slot, now: float, why: str) -> None:
        """Ask the node to finish its in-flight turns and give its leases back."""
        if slot.up:
            slot.actor.drain.remote()
        slot.drain_until = now + self.sup.drain_timeout_s
        self.sup.buffer.event(
            "worker.draining",
            f"{slot.name} draining: {why}",
            {"slot": slot.name, "ray_node_id": slot.node_id, "reason": why},
        )
        self.sup.say(
            f"{slot.name}: draining ({why}): finishing its turns, giving its episodes back"
        )
        self.sup.set_state(slot, "draining", why)

    def drained(self, slot: Slot, now: float) -> None:
        import ray

        done = slot.run_ref is None or bool(ray.wait([slot.run_ref], timeout=0)[0])
        if not done and now < slot.drain_until and slot.up:
            return
        note = "" if done and slot.up else f" (not done within {self.sup.drain_timeout_s:.0f} s)"
        if done and slot.run_ref is not None:
            with contextlib.suppress(Exception):  # it ended with an error: no report
                self.sup.final_reports.append(ray.get(slot.run_ref, timeout=0))
        self.sup.end_incarnation(slot, counted=False)  # whatever it still holds goes back
        self.sup.buffer.event(
            "worker.drained",
            f"{slot.name} drained{note}",
            {"slot": slot.name, "ray_node_id": slot.node_id},
        )
        self.sup.say(f"{slot.name}: drained{note}")
        if slot.remove:
            self.removed(slot)
            return
        self.regroup(slot)
        slot.next_start_at = 0.0
        slot.said_waiting = False
        self.sup.set_state(slot, "waiting_capacity", "moved off its draining machine")
        self.sup.place(slot, now)

    def removed(self, slot: Slot) -> None:
        if slot.actor is not None:  # else its last incarnation has ended already
            self.sup.end_incarnation(slot, counted=False)
        slot.up = False
        if self.sup.placement is not None:
            self.sup.placement.drop(slot.group)
        self.sup.buffer.event("worker.removed", f"{slot.name} removed", {"slot": slot.name})
        self.sup.set_state(slot, "removed", "the job scaled down")
