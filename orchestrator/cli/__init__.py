"""The ``rollcall`` command line.

Command modules import SQLAlchemy, torch and ray inside the commands that need them, so
``rollcall --help`` answers quickly. ``main`` turns a ``UserError`` into one line on stderr and
its exit code.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from rollcall.orchestrator import __version__
from rollcall.orchestrator.cli import configs as config_cmd
from rollcall.orchestrator.cli import db as db_cmd
from rollcall.orchestrator.cli import drill as drill_cmd
from rollcall.orchestrator.cli import job as job_cmd
from rollcall.orchestrator.cli import model as model_cmd
from rollcall.orchestrator.cli import node as node_cmd
from rollcall.orchestrator.cli import quickstart as quickstart_cmd
from rollcall.orchestrator.cli import rollout as rollout_cmd
from rollcall.orchestrator.cli import run as run_cmd
from rollcall.orchestrator.cli import status as status_cmd
from rollcall.orchestrator.cli import task as task_cmd
from rollcall.orchestrator.cli.common import GlobalOptions
from rollcall.orchestrator.errors import UserError

app = typer.Typer(
    name="rollcall",
    help="Fault-tolerant, multi-task orchestrator for asynchronous RL of LLM agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # help paragraphs reflow (rich mode keeps their line breaks)
)
app.add_typer(config_cmd.app, name="config")
app.add_typer(db_cmd.app, name="db")
app.add_typer(drill_cmd.app, name="drill")
app.add_typer(job_cmd.app, name="job")
app.add_typer(task_cmd.app, name="task")
app.add_typer(model_cmd.app, name="model")
app.add_typer(node_cmd.app, name="node")
app.add_typer(rollout_cmd.app, name="rollout")
app.add_typer(status_cmd.worker_app, name="worker")
app.add_typer(status_cmd.buffer_app, name="buffer")
app.command("quickstart")(quickstart_cmd.quickstart)
app.command("run")(run_cmd.run)
app.command("status")(status_cmd.status)
app.command("events")(status_cmd.events)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"rollcall {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    database_url: Annotated[
        str | None,
        typer.Option(
            "--database-url",
            envvar="ROLLCALL_DATABASE_URL",
            help="External PostgreSQL URL. Unset: the embedded PostgreSQL in ROLLCALL_HOME.",
            show_default=False,
        ),
    ] = None,
    home: Annotated[
        str | None,
        typer.Option(
            "--home",
            envvar="ROLLCALL_HOME",
            help=(
                "State directory (embedded PostgreSQL, runs). Default: ~/.rollcall "
                "(root: /var/lib/rollcall)."
            ),
            show_default=False,
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            envvar="ROLLCALL_CONFIG",
            help="Job config YAML whose database.url is used when no URL is given.",
            show_default=False,
        ),
    ] = None,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    ctx.obj = GlobalOptions(database_url=database_url, home=home, config=config)


def main(argv: list[str] | None = None) -> None:

    try:
        app(args=argv, prog_name="rollcall")
    except UserError as e:
        from rich.markup import escape

        from rollcall.orchestrator.cli.common import err_console

        err_console().print(f"[bold red]error:[/] {escape(str(e))}", markup=True)
        sys.exit(e.exit_code)
