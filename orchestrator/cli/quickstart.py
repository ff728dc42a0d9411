"""``rollcall quickstart``: the README's first command.

It runs the shipped ``quickstart`` config (``configs/quickstart.yaml`` in the source tree,
``rollcall/configs/quickstart.yaml`` in the installed package; ``rollcall config show
quickstart`` prints it): starts the embedded PostgreSQL (unless the config names a
database), migrates it to head, builds the tiny local model if it is missing, and runs the job
(rollout nodes and the trainer on a local Ray) until its last step. A second quickstart starts
a new job (``quickstart-2``, ...) unless ``--resume`` continues the last one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rollcall.orchestrator.cli.configs import shipped_config
from rollcall.orchestrator.errors import UserError


def quickstart(
    ctx: typer.Context,
    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            help="dotted.key=value overrides, e.g. run.total_steps=10", show_default=False
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="Job config (default: the shipped quickstart config, `rollcall config show "
            "quickstart`).",
            show_default=False,
        ),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the quickstart job instead of a new one.")
    ] = False,
    live: Annotated[
        bool, typer.Option("--live/--no-live", help="Live progress panel on a terminal.")
    ] = True,
    json_out: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Train the tiny model on the built-in tasks (CPU, embedded PostgreSQL, local Ray).

    Starts and migrates the embedded PostgreSQL (unless the config names a database), copies
    the shipped tiny model into ROLLCALL_HOME/models/tiny if it is missing, and runs the
    shipped quickstart config (`rollcall config show quickstart`) to the end. A second
    quickstart runs a new job (quickstart-2, ...) unless --resume continues the last one."""
    from rollcall.orchestrator.cli.run import report, run_job
    from rollcall.orchestrator.config import load_config

    path = config or shipped_config("quickstart")
    if not path.exists():
        raise UserError(f"quickstart config {path} does not exist; pass --config FILE")
    cfg = load_config(path, overrides or [])
    result = run_job(ctx, cfg, resume=resume, live=live, upgrade_schema="always", fresh_name=True)
    report(result, json_out)
