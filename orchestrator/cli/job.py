"""``rollcall job``: create, list, show, stop and scale jobs."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from rollcall.orchestrator.cli.common import (
    actor,
    col,
    compact_table,
    console,
    one_line,
    open_db,
    print_json,
)
from rollcall.orchestrator.errors import ConflictError

app = typer.Typer(
    help="Jobs: long-running training runs that tasks belong to.", no_args_is_help=True
)


@app.command()
def create(ctx: typer.Context, name: Annotated[str, typer.Argument(help="Job name.")]) -> None:
    """Create an empty job."""
    from rollcall.orchestrator.services.jobs import create_job

    db = open_db(ctx)
    try:
        with db.transaction() as tx:
            job = create_job(tx, name, actor=actor())
    finally:
        db.dispose()
    console().print(f"Job {job.name!r} created (id {job.id}).", markup=False)


@app.command("list")
def list_(
    ctx: typer.Context,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List jobs with their status (created, running, stopping, finished, stopped, failed)."""
    db = open_db(ctx)
    try:
        with db.transaction() as tx:
            jobs = tx.jobs.list()
            ntasks = {j.id: len(tx.tasks.list(j.id, include_retired=False)) for j in jobs}
    finally:
        db.dispose()
    if json_out:
        print_json([{**j.to_json(), "tasks": ntasks[j.id]} for j in jobs])
        return
    console().print(jobs_table([{**j.to_json(), "tasks": ntasks[j.id]} for j in jobs]))


def jobs_table(jobs: list[dict[str, Any]]) -> Any:
    """``job list`` as a table, from the rows of its ``--json`` output."""
    table = compact_table(
        col("name", flex=True),
        "status",
        col("version", right=True),
        col("tasks", right=True),
        "created",
    )
    for j in jobs:
        table.add_row(
            *one_line(
                j["name"],
                j["status"],
                str(j["policy_version"]),
                str(j["tasks"]),
                j["created_at"][:19].replace("T", " "),
            )
        )
    return table


@app.command()
def show(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Job name.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show a job, its driver, its tasks and its recent events."""
    from rollcall.orchestrator.services.jobs import driver_json, driver_line, require_job

    db = open_db(ctx)
    try:
        with db.transaction() as tx:
            job = require_job(tx, name)
            alive = tx.jobs.driver_alive(job.id)
            tasks = tx.tasks.list(job.id)
            events = tx.events.list(job_id=job.id, limit=10)
    finally:
        db.dispose()
    if json_out:
        print_json(
            {
                **job.to_json(),
                "driver": driver_json(job, alive),
                "tasks": [t.to_json() for t in tasks],
                "recent_events": [e.to_json() for e in events],
            }
        )
        return
    out = console()
    out.print(
        f"job {job.name} (id {job.id}): {job.status.value}, policy version {job.policy_version}",
        markup=False,
    )
    if line := driver_line(job, alive):
        out.print(f"  {line}", markup=False)
    for t in tasks:
        out.print(
            f"  task {t.name}: {t.plugin}, {t.status.value}, weight {t.weight:g}", markup=False
        )
    for e in events:
        out.print(f"  {e.created_at:%Y-%m-%d %H:%M:%S}  {e.kind}  {e.message}", markup=False)


@app.command()
def stop(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Job name.")],
    wait: Annotated[
        bool, typer.Option("--wait", help="Wait until the driver has stopped the job.")
    ] = False,
    timeout: Annotated[
        float, typer.Option("--timeout", min=1.0, help="Seconds --wait waits at most.")
    ] = 600.0,
) -> None:
    """Stop a running job gracefully, from any terminal: its driver finishes the step in
    progress, stops the rollout nodes (their episodes are checkpointed), evaluates and saves
    the policy; `rollcall run CONFIG --resume` continues it later."""
    import time

    from rollcall.orchestrator.services.jobs import request_stop, require_job

    out = console()
    db = open_db(ctx)
    try:
        with db.transaction() as tx:
            asked = request_stop(tx, name, actor=actor())
        out.print(
            f"Stop requested for job {name!r}: its driver finishes the step in progress, stops "
            "the rollout nodes, evaluates and saves the policy."
            if asked
            else f"A stop of job {name!r} was already requested; its driver is stopping.",
            markup=False,
        )
        if not wait:
            return
        deadline = time.monotonic() + timeout
        while True:
            with db.transaction() as tx:
                job = require_job(tx, name)
                if not tx.jobs.driver_alive(job.id):
                    break
            if time.monotonic() >= deadline:
                raise ConflictError(
                    f"job {name!r} is still stopping after {timeout:g} s (--timeout); its driver "
                    "finishes the step in progress first: wait longer or watch `rollcall status`"
                )
            time.sleep(1.0)
        out.print(f"Job {name!r} {job.status.value} at policy version {job.policy_version}.")
    finally:
        db.dispose()


@app.command()
def scale(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Job name.")],
    rollout_nodes: Annotated[
        int, typer.Option("--rollout-nodes", help="Rollout nodes the job should have.")
    ],
) -> None:
    """Grow or shrink a running job's rollout fleet: new nodes start where the Ray cluster has
    room (or wait for it, shown in `rollcall status`); removed ones finish their in-flight
    turns, checkpoint them and give their episodes back first, so nothing generated is lost."""
    from rollcall.orchestrator.services.jobs import scale as scale_job

    db = open_db(ctx)
    try:
        with db.transaction() as tx:
            before = scale_job(tx, name, rollout_nodes, actor=actor())
        console().print(
            f"Job {name!r}: {before} -> {rollout_nodes} rollout nodes; its driver "
            + (
                "starts the new ones where the Ray cluster has room."
                if rollout_nodes > before
                else "drains the extra ones (their turns are checkpointed, their episodes "
                "given back)."
                if rollout_nodes < before
                else "already has that many."
            ),
            markup=False,
        )
    finally:
        db.dispose()
