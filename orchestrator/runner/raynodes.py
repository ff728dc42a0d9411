"""What Ray says about its machines, for the supervisor: which Ray nodes are alive or draining,
what Ray recorded about an actor's death, and whether a machine still answers.

A rollout node's death is charged to its restart budget only when its machine is known to be
alive. Ray's structured words, in the order the supervisor uses them:

- the actor table (``ray._private.state.actors``): an actor Ray recorded dead with the reason
  ``NODE_DIED``, or preempted by a drain, died with its machine; one recorded dead for another
  reason (its worker process died, it was killed, out of memory) died on a machine whose raylet
  was there to report it: that death is the node's own;
- the node table (``ray.nodes()``): a node not alive is a lost machine;
- a probe (``probe``): a zero-CPU task pinned to the node that answers proves the machine
  alive. A machine that lost power answers nothing and Ray's health checks mark it dead after
  some seconds (``health_check_*`` in Ray's system config). Measured on a ``ray start``
  cluster with Ray's defaults (ops/bench/RESULTS.md): 13-15 s for a machine whose processes
  are gone (its raylet's port refuses the checks), 63-64 s for one that answers nothing (a
  frozen machine, as one that lost power or its network: 5 checks, each 3 s apart with a
  10 s timeout); until one of the two happens the verdict waits, at most
  ``rollout.machine_verdict_s`` (120 s).

All of it goes through Ray's GCS; an answer Ray cannot give (its control store away) is
``None``, and the supervisor waits for a later pass.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

log = logging.getLogger(__name__)


def nodes() -> dict[str, dict[str, Any]] | None:
    """Ray's node table by node id (None: Ray cannot answer now)."""
    import ray

    try:
        return {str(n["NodeID"]): n for n in ray.nodes()}
    except Exception:
        log.debug("Ray's node table could not be read", exc_info=True)
        return None


def draining() -> set[str]:
    """The Ray nodes being drained (``ray drain-node``, an autoscaler, ``rollcall node drain``):
    Ray places nothing new on them."""
    from ray._private import state

    try:
        return set(state.state.get_draining_nodes())
    except Exception:
        log.debug("Ray's draining nodes could not be read", exc_info=True)
        return set()


def host(table: dict[str, dict[str, Any]] | None, node_id: str | None) -> str:
    """``NODE8 (host)`` for lines and events."""
    if node_id is None:
        return "an unknown Ray node"
    n = (table or {}).get(node_id) or {}
    where = n.get("NodeManagerHostname") or n.get("NodeManagerAddress")
    return f"Ray node {node_id[:8]}" + (f" ({where})" if where else "")


def actor_death(actor: Any) -> str | None:
    """What Ray's actor table says of the actor: ``"node_died"`` (it died with its machine, or
    was preempted by a drain), ``"own"`` (recorded dead for another reason: its machine's
    raylet reported it), ``"alive"`` (not recorded dead yet: unreachable, no verdict), or None
    (Ray cannot answer)."""
    from ray._private import state

    try:
        info = state.actors(actor._actor_id.hex())
    except Exception:
        log.debug("Ray's actor table could not be read", exc_info=True)
        return None
    if not info:
        return None
    if info.get("State") != "DEAD":
        return "alive"
    cause = info.get("DeathCause")
    context = cause.WhichOneof("context") if cause is not None else None
    if context == "actor_died_error_context":
        died = cause.actor_died_error_context
        from ray.core.generated.common_pb2 import (  # type: ignore[attr-defined]
            ActorDiedErrorContext,
            NodeDeathInfo,
        )

        if died.reason == ActorDiedErrorContext.NODE_DIED:
            return "node_died"
        if died.node_death_info.reason == NodeDeathInfo.AUTOSCALER_DRAIN_PREEMPTED:
            return "node_died"
    return "own"


def probe(node_id: str) -> Any:
    """A zero-CPU task pinned to the node: its answer (``ray.wait`` on the returned reference)
    proves the machine alive. None when Ray refuses to schedule it (the node is gone)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        return _here.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
        ).remote()
    except Exception:
        log.debug("could not probe Ray node %s", node_id, exc_info=True)
        return None


def answered(ref: Any) -> bool:
    """Whether a probe came back (a probe that failed proves nothing)."""
    import ray

    if ref is None:
        return False
    ready, _ = ray.wait([ref], timeout=0)
    if not ready:
        return False
    with contextlib.suppress(Exception):
        return bool(ray.get(ref, timeout=0))
    return False


def _remote_here() -> Any:
    import ray

    @ray.remote(num_cpus=0, max_retries=0)
    def here() -> bool:
        return True

    return here


class _Lazy:
    """``_here``: the probe task, defined on first use (importing Ray lazily)."""

    fn: Any = None

    def options(self, **kw: Any) -> Any:
        if _Lazy.fn is None:
            _Lazy.fn = _remote_here()
        return _Lazy.fn.options(**kw)


_here = _Lazy()
