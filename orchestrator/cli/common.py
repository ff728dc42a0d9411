"""What every command shares: global options, opening the database, output helpers."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from orchestrator.db.engine import Database


@dataclass
class GlobalOptions:
    database_url: str | None = None
    home: str | None = None
    config: Path | None = None

    def config_database_url(self) -> str | None:
        """``database.url`` of the ``--config`` file, if one was given and sets it."""
        if self.config is None:
            return None
        from orchestrator.config import load_config

        url = load_config(self.config).database.url
        return url.get_secret_value() if url is not None else None


def options(ctx: typer.Context) -> GlobalOptions:
    obj = ctx.find_root().obj
    return obj if isinstance(obj, GlobalOptions) else GlobalOptions()


def open_db(ctx: typer.Context, *, verify_schema: bool = True) -> Database:
    from orchestrator.db.engine import open_database

    opts = options(ctx)
    return open_database(
        opts.database_url,
        opts.config_database_url(),
        home=opts.home,
        verify_schema=verify_schema,
    )


def console() -> Console:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True)


def err_console() -> Console:
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def table(*headers: str) -> Any:
    """A rich table whose cells wrap instead of being cut off."""
    from rich.table import Table

    t = Table()
    for h in headers:
        t.add_column(h, overflow="fold")
    return t


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def actor() -> str:
    from orchestrator.services.jobs import operator_actor

    return operator_actor()
