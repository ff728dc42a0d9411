"""A rollout slot of the supervisor (``Slot``), and how the death of one of its incarnations is
judged from Ray's structured words: the node's own (``OWN``, counted against its restart
budget), its machine's (``MACHINE``, not counted), or ``UNKNOWN`` until Ray says whether the
machine is alive (``orchestrator/runner/supervisor.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rollcall.orchestrator.runner import raynodes

# how a death is judged: the node's own (counted), its machine's (not counted), or unknown
# until Ray says whether the machine is alive
OWN, MACHINE, UNKNOWN = "own", "machine", "unknown"
# what a failed start's event keeps of its error (``_evidence``): a tail, a few KB
EVIDENCE_LINES = 40
EVIDENCE_BYTES = 4096


@dataclass
class Slot:
    name: str
    index: int
    group: Any = None  # its placement group (None: no reservation, placed anywhere)
    state: str = "waiting_capacity"
    since: float = field(default_factory=time.monotonic)  # in this state since
    reason: str | None = None  # why it is in its state
    actor: Any = None
    run_ref: Any = None
    worker_ref: Any = None
    worker_id: int | None = None
    prev_worker_id: int | None = None  # the slot's latest incarnation before this start
    node_id: str | None = None  # the Ray node the incarnation runs on
    up: bool = False  # its constructor finished: the engine is up
    registered_at: float = 0.0
    restarts: int = 0  # counted within the window
    streak: int = 0  # counted deaths in a row, each soon after its start: the backoff's n
    died_at: float = 0.0  # when its latest incarnation was found down
    losses: int = 0  # machine losses (not counted)
    started_at: float = 0.0
    next_start_at: float = 0.0
    said_waiting: bool = False
    # no waiting line before this (Ray places a new group, or re-places a lost machine's,
    # within moments where there is room)
    quiet_until: float = 0.0
    verdict: dict[str, Any] | None = None  # awaiting Ray: the death, the node, a probe, until
    down: tuple[str, str] | None = None  # a death (reason, judgement) still to be judged
    drain_until: float = 0.0
    remove: bool = False  # scaled away: removed once drained
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.state == "failed"


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


def _evidence(e: BaseException) -> list[str]:
    """What a failed start leaves to explain it: the last lines of Ray's text of the error (the
    traceback ending with the exception's message; a vLLM engine's message holds what vLLM's
    processes wrote as it failed, ``workers/rollout/engines/startlog.py``), at most
    ``EVIDENCE_LINES`` lines, ``EVIDENCE_BYTES`` in all."""
    lines = [ln.rstrip() for ln in str(e).splitlines() if ln.strip()][-EVIDENCE_LINES:]
    while lines and sum(len(ln) + 1 for ln in lines) > EVIDENCE_BYTES:
        lines = lines[1:]
    return lines


def _judge_error(e: BaseException, slot: Slot | None = None) -> str:
    """How an actor's error is judged, from Ray's structured words only, never message text:
    the node's own code raised (``RayTaskError``, a constructor that raised): ``OWN``;
    ``NodeDiedError`` or a preempted actor: ``MACHINE``; any other actor death: what Ray's
    actor table recorded (died with its node: ``MACHINE``; dead for another reason, reported
    by its machine's raylet: ``OWN``; not recorded dead yet, as for an actor that became
    unreachable: ``UNKNOWN``, the machine's verdict decides)."""
    import ray.exceptions

    if isinstance(e, ray.exceptions.NodeDiedError):
        return MACHINE
    if isinstance(e, ray.exceptions.RayTaskError):  # the node's own code raised: its failure
        return OWN
    if isinstance(e, ray.exceptions.RayActorError):
        if e.actor_init_failed:  # its constructor raised
            return OWN
        if e.preempted:
            return MACHINE
        death = raynodes.actor_death(slot.actor) if slot is not None and slot.actor else None
        if death == "node_died":
            return MACHINE
        if death == "own":
            return OWN
        return UNKNOWN
    return OWN


def _machine_lost(e: BaseException, node_id: str | None = None) -> bool:
    """Whether Ray says at once that the actor's machine is gone: ``NodeDiedError``, a
    preempted actor, or (for another actor death) its Ray node ``node_id`` no longer alive in
    Ray's node table. A death this cannot tell (``UNKNOWN``) waits for Ray's verdict in the
    supervisor."""
    judged = _judge_error(e)
    if judged == UNKNOWN:
        return node_id is not None and not _ray_node_alive(node_id)
    return judged == MACHINE


def _ray_node_alive(node_id: str) -> bool:
    table = raynodes.nodes()
    if table is None or node_id not in table:
        return True  # no structured answer: count it
    return bool(table[node_id].get("Alive"))
