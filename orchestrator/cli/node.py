"""``rollcall node``: the machines of a job's Ray cluster, and draining one."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from rollcall.orchestrator.cli.common import (
    col,
    compact_table,
    console,
    one_line,
    open_db,
    print_json,
)

app = typer.Typer(help="The Ray cluster's machines (nodes) under a job.", no_args_is_help=True)

JobOpt = Annotated[
    str | None, typer.Option("--job", help="The job whose Ray cluster to use (its driver's).")
]
AddressOpt = Annotated[
    str | None,
    typer.Option("--address", help="The Ray head's GCS address HOST:PORT (instead of --job)."),
]


@app.command("list")
def list_(
    ctx: typer.Context,
    job: JobOpt = None,
    address: AddressOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Ray's nodes: alive, draining or dead, their resources and, with --job, the job's
    rollout slots placed on each (what the Ray dashboard would show, without it)."""
    from rollcall.orchestrator.services.jobs import require_job
    from rollcall.orchestrator.services.nodes import gcs_address, ray_nodes

    db = open_db(ctx)
    try:
        where = gcs_address(db, job, address)
        slots: dict[str, list[str]] = {}
        if job is not None:
            with db.transaction() as tx:
                for s in tx.fleet.slots(require_job(tx, job).id):
                    if s["ray_node_id"] and s["state"] in ("starting", "alive", "draining"):
                        slots.setdefault(s["ray_node_id"], []).append(s["name"])
        nodes = ray_nodes(where, db.target.home)
    finally:
        db.dispose()
    rows: list[dict[str, Any]] = [
        {
            "node_id": n.node_id,
            "address": n.address,
            "state": "dead" if not n.alive else "draining" if n.draining else "alive",
            "head": n.head,
            "resources": {k: v for k, v in n.resources.items() if not k.startswith("node:")},
            "rollout_slots": slots.get(n.node_id, []),
        }
        for n in nodes
    ]
    if as_json:
        print_json(rows)
        return
    t = compact_table(
        col("node"), col("address"), col("state"), col("resources", flex=True), col("slots")
    )
    for r in rows:
        res = ", ".join(f"{v:g} {k}" for k, v in sorted(r["resources"].items()))
        t.add_row(
            *one_line(
                r["node_id"][:8] + (" (head)" if r["head"] else ""),
                r["address"],
                r["state"],
                res,
                ", ".join(r["rollout_slots"]) or "-",
            )
        )
    console().print(t)


@app.command()
def drain(
    ctx: typer.Context,
    node: Annotated[str, typer.Argument(help="The Ray node id (or its first characters).")],
    job: JobOpt = None,
    address: AddressOpt = None,
    deadline_s: Annotated[
        float | None,
        typer.Option(
            "--deadline-s", min=0.0, help="Tell Ray the machine goes away in this many seconds."
        ),
    ] = None,
) -> None:
    """Drain a machine before removing it: Ray places nothing new on it, and the rollout nodes
    it hosts finish their in-flight turns, checkpoint them and give their episodes back, then
    start where the cluster has room (or wait for it). Ray ends the machine's raylet once it
    is idle. The turns its nodes generated are kept. For rollout machines: a trainer rank on a
    drained machine is not moved (with --deadline-s, it is lost at the deadline)."""
    from rollcall.orchestrator.cli.common import actor
    from rollcall.orchestrator.services.nodes import drain as drain_node
    from rollcall.orchestrator.services.nodes import gcs_address

    db = open_db(ctx)
    try:
        where = gcs_address(db, job, address)
    finally:
        db.dispose()
    n = drain_node(
        where, node, deadline_s=deadline_s, reason=f"rollcall node drain by {actor()}",
        home=db.target.home,
    )  # fmt: skip
    if job is not None:  # the operator's action, in the job's audit log
        from rollcall.orchestrator.services.jobs import require_job

        db = open_db(ctx)
        try:
            with db.transaction() as tx:
                tx.events.add(
                    "node.drain_requested",
                    actor(),
                    f"Ray node {n.node_id[:8]} ({n.address}) drained by an operator",
                    job_id=require_job(tx, job).id,
                    payload={"ray_node_id": n.node_id, "deadline_s": deadline_s},
                )
        finally:
            db.dispose()
    console().print(
        f"Ray node {n.node_id[:8]} ({n.address}) is draining: nothing new is placed on it; "
        "rollout nodes on it give their episodes back and move (`rollcall status` shows "
        "them); Ray ends it once it is idle.",
        markup=False,
    )
