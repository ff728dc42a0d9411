"""Driver-level access for the hot paths (claims, checkpoints, commits).

SQLAlchemy's per-statement overhead is about three times the whole client cost of a commit
done with psycopg directly (measured: 1.7 ms vs 0.5 ms CPU per 4K-token commit). The hot
repository methods therefore run their SQL on the psycopg connection that the session's
transaction already holds: same transaction, same commit, none of the overhead.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import namedtuple_row
from psycopg.types.json import Jsonb
from sqlalchemy.orm import Session

from rollcall.orchestrator.db import jsontext


def cursor(session: Session) -> psycopg.Cursor[Any]:
    """A cursor on the session's connection, inside its current transaction."""
    dbapi = session.connection().connection.driver_connection
    assert isinstance(dbapi, psycopg.Connection)
    return dbapi.cursor(row_factory=namedtuple_row)


def jsonb(value: Any) -> Jsonb:
    return Jsonb(value, dumps=jsontext.dumps)
