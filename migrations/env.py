"""Alembic environment: runs online against the connection rollcall passes in.

``rollcall db upgrade`` (``rollcall.orchestrator.db.migrate``) puts an open connection in
``config.attributes["connection"]``. Run from the ``alembic`` command line (development only:
``alembic revision --autogenerate``), the URL comes from the usual rollcall resolution.
"""

from __future__ import annotations

from alembic import context

from rollcall.orchestrator.db.engine import open_database
from rollcall.orchestrator.db.migrate import include_name, include_object
from rollcall.orchestrator.db.models import Base

config = context.config
target_metadata = Base.metadata


def _configure_and_run(connection: object) -> None:
    context.configure(
        connection=connection,  # type: ignore[arg-type]
        target_metadata=target_metadata,
        include_name=include_name,
        include_object=include_object,
        compare_type=True,
        transaction_per_migration=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure_and_run(connection)
        return

    db = open_database(verify_schema=False)
    try:
        with db.engine.connect() as conn:
            _configure_and_run(conn)
            conn.commit()
    finally:
        db.dispose()


if context.is_offline_mode():
    raise SystemExit("rollcall migrations run online only: use `rollcall db upgrade`")
run_migrations_online()
