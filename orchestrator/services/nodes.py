"""The machines of a job's Ray cluster, for operators (``rollcall node``): list them with the
job's rollout slots on each, and drain one (Ray's draining: nothing new is placed on it; the
supervisor moves the rollout nodes it hosts elsewhere once they have given their in-flight
turns back; Ray ends the machine's raylet once it is idle)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollcall.orchestrator import rayauth
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.errors import ConflictError, NotFoundError, UserError
from rollcall.orchestrator.services.jobs import require_job


@dataclass
class RayNode:
    node_id: str
    address: str
    alive: bool
    draining: bool
    head: bool
    resources: dict[str, float]


def gcs_address(db: Database, job: str | None, address: str | None) -> str:
    """The GCS address: ``--address``, else the one the job's driver recorded, else
    ``RAY_ADDRESS``."""
    if address:
        return address
    if job is not None:
        with db.transaction() as tx:
            info = require_job(tx, job).driver or {}
        if info.get("ray_address"):
            return str(info["ray_address"])
        raise ConflictError(
            f"job {job!r} has no Ray address recorded (its driver is older, or never ran); "
            "pass --address HOST:PORT (the Ray head's GCS)"
        )
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    raise UserError("name the job (--job) or the Ray cluster (--address HOST:PORT)")


def _client(address: str, home: str | Path | None = None) -> Any:
    rayauth.configure_client(home)  # the job's Ray token (a local job's, or the operator's)
    return _ray("ray._raylet").GcsClient(address=address)


def _ray(module: str) -> Any:
    """A module of Ray's internals (imported late: the CLI starts without Ray)."""
    import importlib

    return importlib.import_module(module)


def ray_nodes(address: str, home: str | Path | None = None) -> list[RayNode]:
    """Every node Ray's GCS knows, alive ones first."""
    gcs_pb2 = _ray("ray.core.generated.gcs_pb2")
    try:
        infos = _client(address, home).get_all_node_info(timeout=10)
    except Exception as e:
        raise ConflictError(f"the Ray cluster at {address} does not answer: {e}") from None
    draining = gcs_pb2.NodeSnapshot.DRAINING
    out = []
    for node_id, info in infos.items():
        out.append(
            RayNode(
                node_id.hex(),
                info.node_manager_address,
                info.state == gcs_pb2.GcsNodeInfo.ALIVE,
                info.state_snapshot.state == draining,
                bool(info.is_head_node),
                dict(info.resources_total),
            )
        )
    return sorted(out, key=lambda n: (not n.alive, not n.head, n.address, n.node_id))


def resolve(nodes: list[RayNode], prefix: str) -> RayNode:
    """The one live node whose id starts with ``prefix`` (lines show 8 characters)."""
    found = [n for n in nodes if n.alive and n.node_id.startswith(prefix.lower())]
    if not found:
        raise NotFoundError(
            f"no live Ray node's id starts with {prefix!r}; `rollcall node list` shows them"
        )
    if len(found) > 1:
        raise UserError(f"{len(found)} Ray nodes' ids start with {prefix!r}; give more of it")
    return found[0]


def drain(
    address: str,
    prefix: str,
    *,
    deadline_s: float | None,
    reason: str,
    home: str | Path | None = None,
) -> RayNode:
    """Ask Ray to drain the node: it places nothing new there, and the job's supervisor moves
    the rollout nodes it hosts (they give their turns back first)."""
    autoscaler_pb2 = _ray("ray.core.generated.autoscaler_pb2")
    node = resolve(ray_nodes(address), prefix)
    if node.head:
        raise UserError(
            f"Ray node {node.node_id[:8]} is the head (it runs Ray's GCS and the job's "
            "driver); it cannot be drained"
        )
    deadline_ms = 0 if deadline_s is None else int((time.time() + deadline_s) * 1000)
    try:
        accepted, why = _client(address, home).drain_node(
            node.node_id,
            autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
            reason,
            deadline_ms,
        )
    except Exception as e:
        raise ConflictError(
            f"the Ray cluster at {address} did not take the drain of node "
            f"{node.node_id[:8]}: {str(e).strip().splitlines()[0] if str(e).strip() else e!r}"
        ) from None
    if not accepted:
        raise ConflictError(f"Ray refused to drain node {node.node_id[:8]}: {why}")
    return node
