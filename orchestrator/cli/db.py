"""``rollcall db``: migrations, drift check, the embedded server."""

from __future__ import annotations

from typing import Annotated

import typer

from rollcall.orchestrator.cli.common import (
    actor,
    console,
    err_console,
    open_db,
    options,
    print_json,
)
from rollcall.orchestrator.errors import ConflictError, SchemaError, UserError
from rollcall.orchestrator.settings import resolve_database

app = typer.Typer(help="Database schema and the embedded PostgreSQL.", no_args_is_help=True)


@app.command()
def upgrade(ctx: typer.Context) -> None:
    """Migrate the schema to the head revision (the only command that runs DDL on an external
    database; quickstart and run also migrate the embedded one)."""
    from rollcall.orchestrator.db import migrate

    db = open_db(ctx, verify_schema=False)
    try:
        with db.migration_connection() as conn:
            before = migrate.current_revision(conn)
            conn.commit()
            migrate.upgrade(conn)
            conn.commit()
            state = migrate.schema_state(conn)
        if before != state.current:
            with db.transaction() as tx:
                tx.events.add(
                    "db.upgraded",
                    actor(),
                    f"schema upgraded from {before or 'empty'} to {state.current}",
                    payload={"from": before, "to": state.current},
                )
            console().print(
                f"Schema upgraded from {before or 'empty'} to {state.current} at {db.describe()}."
            )
        else:
            console().print(f"Schema already at head ({state.current}) at {db.describe()}.")
    finally:
        db.dispose()


@app.command()
def current(
    ctx: typer.Context,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show the schema revision of the database and the head this rollcall expects."""
    from rollcall.orchestrator.db import migrate

    db = open_db(ctx, verify_schema=False)
    try:
        with db.engine.connect() as conn:
            state = migrate.schema_state(conn)
    finally:
        db.dispose()
    if json_out:
        print_json(
            {
                "current": state.current,
                "head": state.head,
                "at_head": state.at_head,
                "database": db.describe(),
            }
        )
        return
    mark = "at head" if state.at_head else "behind head: run `rollcall db upgrade`"
    console().print(f"current: {state.current or '(empty)'}  head: {state.head}  ({mark})")


@app.command()
def check(ctx: typer.Context) -> None:
    """Exit non-zero when the schema is behind head or differs from the models."""
    from rollcall.orchestrator.db import migrate

    db = open_db(ctx, verify_schema=False)
    try:
        with db.engine.connect() as conn:
            migrate.verify_at_head(conn)
            diffs = migrate.drift(conn)
    finally:
        db.dispose()
    if diffs:
        err = err_console()
        for d in diffs:
            err.print(f"  drift: {d}", markup=False)
        raise SchemaError(
            f"the migrated schema differs from the models in {len(diffs)} place(s); write a "
            "migration for the change"
        )
    console().print("Schema is at head and matches the models.")


@app.command()
def status(
    ctx: typer.Context,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Where the database is and, when embedded, whether its server is running (and its
    pid)."""
    from rollcall.orchestrator.db.embedded import EmbeddedPostgres

    opts = options(ctx)
    target = resolve_database(opts.database_url, opts.config_database_url(), opts.home)
    if not target.embedded:
        data = {"embedded": False, "database": target.describe()}
    else:
        data = {"embedded": True, **EmbeddedPostgres(target.home).status().to_json()}
    if json_out:
        print_json(data)
        return
    for k, v in data.items():
        console().print(f"{k}: {v}", markup=False)


@app.command()
def stop(
    ctx: typer.Context,
    yes: Annotated[
        bool, typer.Option("--yes", help="Stop it even while a job's driver is using it.")
    ] = False,
) -> None:
    """Stop the embedded PostgreSQL server (it starts again on next use). Refused while a job
    runs on it, unless --yes."""
    from rollcall.orchestrator.db.embedded import EmbeddedPostgres

    opts = options(ctx)
    target = resolve_database(opts.database_url, opts.config_database_url(), opts.home)
    if not target.embedded:
        raise UserError(
            f"`db stop` manages the embedded PostgreSQL only, and the database is external "
            f"({target.describe()}); stop it with its own tools"
        )
    server = EmbeddedPostgres(target.home)
    if not yes and server.status().running:
        _refuse_while_jobs_run(server.url())
    stopped = server.stop()
    console().print(
        "Embedded PostgreSQL stopped." if stopped else "Embedded PostgreSQL was not running."
    )


def _refuse_while_jobs_run(url: str) -> None:
    """``db stop`` under a running job would stop the job's database: refuse, naming it."""
    from rollcall.orchestrator.db.engine import open_database

    db = open_database(url, verify_schema=False)
    try:
        with db.transaction() as tx:
            live = tx.jobs.live_drivers()
    finally:
        db.dispose()
    if not live:
        return
    first = live[0]
    if first.job_name is not None:
        what = f"job {first.job_name!r} is running on it"
        how = f"stop it first with `rollcall job stop {first.job_name} --wait`"
    else:
        what = f"a job (id {first.job_id} in database {first.database!r}) is running on it"
        how = "stop it first with `rollcall job stop NAME --wait`"
    more = f" (and {len(live) - 1} more)" if len(live) > 1 else ""
    raise ConflictError(
        f"the embedded PostgreSQL was not stopped: {what}{more}; {how}, or pass --yes to stop "
        "the database under it"
    )
