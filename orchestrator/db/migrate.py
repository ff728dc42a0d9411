"""Schema migrations: upgrade, current revision, drift check, head verification.

Only ``upgrade`` (``rollcall db upgrade``) runs DDL. Every other process calls
``verify_at_head`` at start and refuses to run against a schema that is behind or unknown.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, inspect

from rollcall.orchestrator.db.models import TRAJECTORY_PARTITION_PREFIX, Base
from rollcall.orchestrator.errors import SchemaError

_PARTITION_RE = re.compile(rf"^{TRAJECTORY_PARTITION_PREFIX}\d+$")

# The schema at head in one file: the tables, indexes, types and every SQL function in their
# current definitions (the migrations are the deltas that add up to it; a test compares them).
SCHEMA_FILE = Path(__file__).with_name("schema.sql")


def migrations_dir() -> Path:
    """``rollcall/migrations``, found by path: the migrations import this package (their
    environment reads the models), never the other way round."""
    return Path(__file__).parents[2] / "migrations"


def alembic_config(connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    heads = ScriptDirectory.from_config(alembic_config()).get_heads()
    if len(heads) != 1:
        raise SchemaError(f"rollcall's migrations have {len(heads)} heads; this build is broken")
    return heads[0]


def current_revision(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """Leave per-task partitions (created at registration, not by migrations) out of diffs."""
    return not (type_ == "table" and name is not None and _PARTITION_RE.match(name))


def include_object(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    return include_name(name, type_, None)


def upgrade(conn: Connection, revision: str = "head") -> None:
    command.upgrade(alembic_config(conn), revision)


def downgrade(conn: Connection, revision: str) -> None:
    command.downgrade(alembic_config(conn), revision)


@dataclass(frozen=True)
class SchemaState:
    current: str | None
    head: str

    @property
    def at_head(self) -> bool:
        return self.current == self.head


def schema_state(conn: Connection) -> SchemaState:
    return SchemaState(current=current_revision(conn), head=head_revision())


def known_revision(revision: str) -> bool:
    """Whether this rollcall's migrations know ``revision`` (not: a newer rollcall's)."""
    try:
        ScriptDirectory.from_config(alembic_config()).get_revision(revision)
    except Exception:
        return False
    return True


def upgrade_if_behind(conn: Connection) -> str | None:
    """Migrate a database with no schema, or one behind head, to head; the revision it was at
    (``"none"`` for no schema), or None when nothing was done (at head, or newer than this
    rollcall: ``verify_at_head`` then says so)."""
    state = schema_state(conn)
    if state.at_head or (state.current is not None and not known_revision(state.current)):
        return None
    upgrade(conn)
    return state.current or "none"


def verify_at_head(conn: Connection) -> None:
    state = schema_state(conn)
    if state.at_head:
        return
    if state.current is None:
        raise SchemaError(
            "the database has no rollcall schema yet; run `rollcall db upgrade` first"
        )
    if not known_revision(state.current):
        raise SchemaError(
            f"the database schema is at revision {state.current}, which this rollcall does not "
            "know (it is newer); upgrade rollcall"
        )
    raise SchemaError(
        f"the database schema is at revision {state.current} but this rollcall needs "
        f"{state.head}; run `rollcall db upgrade`"
    )


def drift(conn: Connection) -> list[str]:
    """Differences between the models and the migrated schema, one line each (empty: none)."""
    ctx = MigrationContext.configure(
        conn,
        opts={
            "include_name": include_name,
            "include_object": include_object,
            "compare_type": True,
            "target_metadata": Base.metadata,
        },
    )
    return [_describe_diff(d) for d in compare_metadata(ctx, Base.metadata)]


def _describe_diff(diff: Any) -> str:
    if isinstance(diff, list):  # modify_* ops come grouped
        return "; ".join(_describe_diff(d) for d in diff)
    op = diff[0]
    rest = ", ".join(str(getattr(x, "name", x)) for x in diff[1:] if x is not None)
    return f"{op}: {rest}"


def partitions(conn: Connection) -> list[str]:
    return sorted(n for n in inspect(conn).get_table_names() if _PARTITION_RE.match(n))
