"""``rollcall job``: create, list and show jobs."""

from __future__ import annotations

from typing import Annotated

import typer

from orchestrator.cli.common import actor, console, open_db, print_json
from orchestrator.cli.common import table as make_table

app = typer.Typer(
    help="Jobs: long-running training runs that tasks belong to.", no_args_is_help=True
)


@app.command()
def create(ctx: typer.Context, name: Annotated[str, typer.Argument(help="Job name.")]) -> None:
    """Create an empty job."""
    from orchestrator.services.jobs import create_job

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
    """List jobs."""
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
    table = make_table("name", "status", "policy version", "tasks", "created")
    for j in jobs:
        table.add_row(
            j.name,
            j.status.value,
            str(j.policy_version),
            str(ntasks[j.id]),
            f"{j.created_at:%Y-%m-%d %H:%M:%S}",
        )
    console().print(table)


@app.command()
def show(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Job name.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show a job, its tasks and its recent events."""
    from orchestrator.services.jobs import require_job

    db = open_db(ctx)
    try:
        with db.transaction() as tx:
            job = require_job(tx, name)
            tasks = tx.tasks.list(job.id)
            events = tx.events.list(job_id=job.id, limit=10)
    finally:
        db.dispose()
    if json_out:
        print_json(
            {
                **job.to_json(),
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
    for t in tasks:
        out.print(
            f"  task {t.name}: {t.plugin}, {t.status.value}, weight {t.weight:g}", markup=False
        )
    for e in events:
        out.print(f"  {e.created_at:%Y-%m-%d %H:%M:%S}  {e.kind}  {e.message}", markup=False)
