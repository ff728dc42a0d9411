"""The job's resources, reserved in Ray for the job's whole life.

At start the driver creates one placement group for the trainer, with one bundle per rank,
and one placement group per rollout node slot, with one bundle: each bundle holds exactly what
its actor asks for (CPUs, GPUs, custom resources). Every trainer rank and rollout node is
scheduled into its own slot's bundle, so a restarted rank or node gets its slot back: what a
dead actor held returns to its bundle, where no other actor (another job's, a node that did not
fit) can take it. A group per rollout slot lets the fleet change under a running job: the
supervisor creates groups for slots added by ``rollcall job scale``, removes those of slots
taken away, and moves a slot off a draining machine by replacing its group (Ray places nothing
new on a draining node). The evaluator asks for no resources (``num_cpus=0``, no GPU) and takes
no slot. The groups share the driver's fate: Ray removes them when the driver exits, and
``Reservation.remove`` does so at the end of the job.

Before reserving, ``check_fits`` refuses with one sentence a job whose resources exceed the
cluster's (``ray.cluster_resources()``) or whose one slot fits no node; a reservation that the
cluster cannot place within ``ray.placement_timeout_s`` is refused the same way. When a Ray node
that held bundles is lost, Ray places those bundles again elsewhere when there is room
(``group_state`` reads ``RESCHEDULING`` until then): a rollout slot waits for it (state
``waiting_capacity``) and a trainer restart waits within ``ray.placement_timeout_s``.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollcall.orchestrator.config import RollcallConfig
from rollcall.orchestrator.errors import UserError


def trainer_bundle(cfg: RollcallConfig) -> dict[str, float]:
    """What one trainer rank asks Ray for (``workers/trainer``'s actors)."""
    t = cfg.trainer
    gpus = 1.0 if t.timing_model is None and t.device == "cuda" else 0.0
    return _bundle(t.cpus_per_rank, gpus, t.resources)


def rollout_bundle(cfg: RollcallConfig) -> dict[str, float]:
    """What one rollout node asks Ray for (``rollout_actor``)."""
    r = cfg.rollout
    return _bundle(r.cpus_per_node, r.gpus_per_node, r.resources)


def trainer_slots(cfg: RollcallConfig) -> int:
    """Trainer actors: one per rank (the timing model is one actor)."""
    return 1 if cfg.trainer.timing_model is not None else cfg.trainer.ranks


def _bundle(cpus: float, gpus: float, resources: Mapping[str, float]) -> dict[str, float]:
    out = {"CPU": float(cpus)}
    if gpus > 0:
        out["GPU"] = float(gpus)
    out.update({k: float(v) for k, v in resources.items() if v > 0})
    return out


def _fields(resource: str, cfg: RollcallConfig) -> str:
    """The config fields that set how much of ``resource`` the job asks for."""
    if resource == "CPU":
        return "trainer.ranks x trainer.cpus_per_rank + rollout.nodes x rollout.cpus_per_node"
    if resource == "GPU":
        parts = []
        if trainer_bundle(cfg).get("GPU"):
            parts.append("trainer.ranks (1 GPU each with trainer.device cuda)")
        if rollout_bundle(cfg).get("GPU"):
            parts.append("rollout.nodes x rollout.gpus_per_node")
        return " + ".join(parts)
    parts = []
    if resource in trainer_bundle(cfg):
        parts.append(f"trainer.ranks x trainer.resources.{resource}")
    if resource in rollout_bundle(cfg):
        parts.append(f"rollout.nodes x rollout.resources.{resource}")
    return " + ".join(parts)


def _show(bundle: Mapping[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in bundle.items())


def check_fits(
    cfg: RollcallConfig, cluster: Mapping[str, float], nodes: Sequence[Mapping[str, float]]
) -> None:
    """Raise ``UserError`` (one sentence naming what is short and the fields to change) when
    the job's slots need more than ``cluster`` (``ray.cluster_resources()``) has in all, or one
    slot more than any node (``nodes``: each alive node's resources) has."""
    more = (
        "add nodes to the Ray cluster"
        if cfg.ray.address
        else "give the local Ray more (ray.num_cpus; GPUs and custom resources need a Ray "
        "cluster that has them, ray.address)"
    )
    slots = [(trainer_bundle(cfg), trainer_slots(cfg)), (rollout_bundle(cfg), cfg.rollout.nodes)]
    need: dict[str, float] = {}
    for bundle, count in slots:
        for k, v in bundle.items():
            need[k] = need.get(k, 0.0) + v * count
    short = [
        f"{v:g} {k} (it has {cluster.get(k, 0.0):g}; {_fields(k, cfg)})"
        for k, v in need.items()
        if v > cluster.get(k, 0.0) + 1e-9
    ]
    if short:
        raise UserError(
            f"the job needs more than the Ray cluster has: {'; '.join(short)}; lower those "
            f"fields or {more}"
        )
    for (bundle, count), what, fields in zip(
        slots,
        ("trainer rank", "rollout node"),
        ("trainer.cpus_per_rank, trainer.device or trainer.resources",
         "rollout.cpus_per_node, rollout.gpus_per_node or rollout.resources"),
        strict=True,
    ):  # fmt: skip
        if count and nodes and not any(_holds(n, bundle) for n in nodes):
            raise UserError(
                f"no Ray node can hold one {what} ({_show(bundle)}): each {what} runs on one "
                f"node; lower {fields}, or add a node that has them"
            )


def _holds(node: Mapping[str, float], bundle: Mapping[str, float]) -> bool:
    return all(node.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())


@dataclass
class Reservation:
    """The job's placement groups: one for the trainer ranks (bundles ``0..trainer-1``) and
    one per rollout node slot (one bundle each, ``slots``), which the supervisor owns from
    the start on: it creates one for a slot added by ``rollcall job scale``, and a new one for
    a slot moved off a draining machine."""

    group: Any
    trainer: int
    slots: list[Any]
    bundle: dict[str, float]  # one rollout node's
    job: str

    def trainer_strategies(self) -> list[Any]:
        return [strategy(self.group, i) for i in range(self.trainer)]

    def new_slot(self, name: str) -> Any:
        """A new placement group for rollout slot ``name`` (Ray places it when it can); the
        reservation keeps it until ``drop`` or ``remove``."""
        from ray.util.placement_group import placement_group

        group = placement_group(
            [self.bundle],
            strategy="PACK",
            name=f"rollcall-{self.job}-{name}-{uuid.uuid4().hex[:6]}",
        )
        self.slots.append(group)
        return group

    def drop(self, group: Any) -> None:
        """Give a rollout slot's group back to the cluster."""
        if group in self.slots:
            self.slots.remove(group)
        remove_group(group)

    def state(self) -> str:
        """Ray's state of the trainer's group: CREATED, PENDING, RESCHEDULING (a node that held
        bundles was lost and they are not placed again yet), REMOVED."""
        return group_state(self.group)[0]

    def remove(self) -> None:
        for g in [self.group, *self.slots]:
            remove_group(g)


def strategy(group: Any, bundle: int = 0) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)


def group_state(group: Any) -> tuple[str, str | None]:
    """Ray's state of a placement group and the Ray node its first bundle is on (None: not
    placed)."""
    from ray.util.placement_group import placement_group_table

    try:
        t = placement_group_table(group)
    except Exception:  # Ray's control store is away: ask again later
        return "UNKNOWN", None
    node = (t.get("bundles_to_node_id") or {}).get(0)
    return str(t.get("state", "UNKNOWN")), (str(node) if node else None)


def remove_group(group: Any) -> None:
    from ray.util.placement_group import remove_placement_group

    with contextlib.suppress(Exception):  # already gone (Ray shut down)
        remove_placement_group(group)


def reserve(cfg: RollcallConfig, *, timeout_s: float) -> Reservation:
    """Check that the job fits the cluster, then reserve its slots; ``UserError`` when it does
    not fit, or the reservation is not placed within ``timeout_s``."""
    import ray
    from ray.util.placement_group import placement_group

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    check_fits(cfg, ray.cluster_resources(), nodes)
    trainer, rollout = trainer_slots(cfg), cfg.rollout.nodes
    group = placement_group(
        [trainer_bundle(cfg)] * trainer,
        strategy="PACK",
        name=f"rollcall-{cfg.job.name}-trainer-{uuid.uuid4().hex[:6]}",
    )
    r = Reservation(group, trainer, [], rollout_bundle(cfg), cfg.job.name)
    for i in range(rollout):
        r.new_slot(f"rollout-{i}")
    ready, _ = ray.wait(
        [g.ready() for g in [group, *r.slots]], num_returns=1 + rollout, timeout=timeout_s
    )
    if len(ready) < 1 + rollout:
        r.remove()
        raise UserError(
            f"the Ray cluster could not reserve the job's resources ({trainer} trainer "
            f"rank(s) of {_show(trainer_bundle(cfg))}, {rollout} rollout node(s) of "
            f"{_show(rollout_bundle(cfg))}) within {timeout_s:g} s (ray.placement_timeout_s): "
            "its nodes lack room for them (other jobs hold resources, or the slots do not "
            "pack onto the nodes); free the cluster, lower the job's resources or raise "
            "ray.placement_timeout_s"
        )
    return r
