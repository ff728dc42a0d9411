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

    from rollcall.orchestrator.db.engine import Database


@dataclass
class GlobalOptions:
    database_url: str | None = None
    home: str | None = None
    config: Path | None = None

    def config_database_url(self) -> str | None:
        """``database.url`` of the ``--config`` file, if one was given and sets it."""
        if self.config is None:
            return None
        from rollcall.orchestrator.config import load_config

        url = load_config(self.config).database.url
        return url.get_secret_value() if url is not None else None


def options(ctx: typer.Context) -> GlobalOptions:
    obj = ctx.find_root().obj
    return obj if isinstance(obj, GlobalOptions) else GlobalOptions()


def open_db(ctx: typer.Context, *, verify_schema: bool = True) -> Database:
    from rollcall.orchestrator.db.engine import open_database

    opts = options(ctx)
    return open_database(
        opts.database_url,
        opts.config_database_url(),
        home=opts.home,
        verify_schema=verify_schema,
    )


def console() -> Console:
    """The console commands print on; every string it prints has its control characters
    escaped (``rollcall.orchestrator.terminal``): events, errors and reasons hold text of
    tools, of the user's code and of the model."""
    from rollcall.orchestrator.terminal import SafeConsole

    return SafeConsole(highlight=False, soft_wrap=True)


def err_console() -> Console:
    from rollcall.orchestrator.terminal import SafeConsole

    return SafeConsole(stderr=True, highlight=False, soft_wrap=True)


def table(*headers: str) -> Any:
    """A rich table whose cells wrap instead of being cut off."""
    from rich.table import Table

    t = Table()
    for h in headers:
        t.add_column(h, overflow="fold")
    return t


def col(header: str, *, right: bool = False, flex: bool = False) -> Any:
    """A column of ``compact_table``: numbers are ``right``-aligned; a ``flex`` column (names,
    hosts, messages) is the one narrowed, with an ellipsis, when the table is too wide."""
    from rich.table import Column

    return Column(
        header,
        justify="right" if right else "left",
        no_wrap=not flex,  # only flex columns are narrowed before the others
        overflow="ellipsis",
    )


def compact_table(*columns: Any) -> Any:
    """A rich table for an 80-column terminal: one line per row, a rule under the header, one
    space between columns. Add rows with ``one_line``; the ``--json`` output has every value
    whole."""
    from rich import box
    from rich.table import Table

    return Table(
        *(col(c) if isinstance(c, str) else c for c in columns),
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=0,
        header_style="bold",
    )


def one_line(*cells: str) -> list[Any]:
    """The cells of a ``compact_table`` row, each cut with an ellipsis rather than wrapped (and
    its control characters escaped)."""
    from rollcall.orchestrator.terminal import safe_text

    return [safe_text(c, no_wrap=True, overflow="ellipsis") for c in cells]


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def actor() -> str:
    from rollcall.orchestrator.services.jobs import operator_actor

    return operator_actor()
