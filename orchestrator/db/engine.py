"""Connections and transactions.

``open_database()`` resolves where the database is (see ``rollcall.orchestrator.settings``), starts
the embedded server when no URL is given, and by default refuses to return unless the schema is at
the Alembic head. ``Database.transaction()`` is the unit of work: the caller (a CLI command, a
scheduler job, an actor method) owns it; repositories inside never commit. On the embedded server
the sessions are the runtime role's and ``Database.migration_connection()`` the migrator's (the
only DDL); an external URL is used for both, as its operator gave it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Connection, Engine, NullPool, create_engine, event, make_url
from sqlalchemy.engine import URL
from sqlalchemy.exc import ArgumentError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from rollcall.orchestrator.db import jsontext
from rollcall.orchestrator.db.embedded import MIGRATOR, EmbeddedPostgres
from rollcall.orchestrator.db.migrate import verify_at_head
from rollcall.orchestrator.db.repos.batches import BatchRepository
from rollcall.orchestrator.db.repos.episodes import EpisodeRepository
from rollcall.orchestrator.db.repos.events import EventRepository
from rollcall.orchestrator.db.repos.fleet import FleetRepository
from rollcall.orchestrator.db.repos.history import HistoryRepository
from rollcall.orchestrator.db.repos.invariants import InvariantRepository
from rollcall.orchestrator.db.repos.jobs import JobRepository
from rollcall.orchestrator.db.repos.monitoring import MonitoringRepository
from rollcall.orchestrator.db.repos.tasks import TaskRepository
from rollcall.orchestrator.db.repos.trajectories import TrajectoryRepository
from rollcall.orchestrator.db.repos.workers import WorkerRepository
from rollcall.orchestrator.db.retry import tls_failure
from rollcall.orchestrator.errors import DatabaseUnavailableError, UserError
from rollcall.orchestrator.settings import DatabaseTarget, mask_url, resolve_database

APPLICATION_NAME = "rollcall"
# PostgreSQL ends a session left idle inside a transaction this long (its process stopped or
# frozen mid-transaction): otherwise it would keep its row locks, which the control plane's
# sweeps skip (``FOR UPDATE SKIP LOCKED``), and a hung worker would never be declared dead.
# Workers pass the heartbeat timeout instead (``control_plane.heartbeat_timeout_s``).
IDLE_TX_TIMEOUT_S = 60.0


def normalise_url(raw: str) -> URL:
    """Accept ``postgresql://``, ``postgres://`` or ``postgresql+psycopg://``; use psycopg 3."""
    try:
        url = make_url(raw)
    except ArgumentError:
        raise UserError(
            f"database URL {mask_url(raw)!r} is not a valid URL; use "
            "postgresql://USER:PASSWORD@HOST:PORT/DATABASE"
        ) from None
    backend = url.get_backend_name()
    if backend not in {"postgresql", "postgres"}:
        raise UserError(
            f"database URL scheme {url.drivername!r} is not supported; rollcall needs PostgreSQL "
            "(postgresql://...)"
        )
    return url.set(drivername="postgresql+psycopg")


@dataclass
class Tx:
    """One transaction and the repositories bound to it."""

    session: Session
    jobs: JobRepository
    tasks: TaskRepository
    events: EventRepository
    episodes: EpisodeRepository
    trajectories: TrajectoryRepository
    batches: BatchRepository
    workers: WorkerRepository
    invariants: InvariantRepository
    monitoring: MonitoringRepository
    fleet: FleetRepository
    history: HistoryRepository


class Database:
    def __init__(
        self,
        url: URL,
        target: DatabaseTarget,
        *,
        pool_size: int = 5,
        max_overflow: int | None = None,
        idle_tx_timeout_s: float = IDLE_TX_TIMEOUT_S,
        migration_url: URL | None = None,
    ) -> None:
        self.url = url
        self.target = target
        self.migration_url = migration_url
        self.engine: Engine = create_engine(
            url,
            # No pre-ping: it costs a round trip and ~0.6 ms of CPU per transaction (measured).
            # A connection broken by a database restart fails its next statement, SQLAlchemy
            # invalidates the pool, and the caller's retry gets a fresh connection.
            pool_pre_ping=False,
            pool_size=pool_size,
            # beyond the pool, as many again unless bounded (a node's pool: its loops wait)
            max_overflow=pool_size if max_overflow is None else max_overflow,
            # a waiter past this gets TimeoutError, which the callers retry (db/retry.py)
            pool_timeout=60,
            connect_args={"application_name": APPLICATION_NAME, "connect_timeout": 10},
            # any text in JSON, U+0000 included (jsonb rejects it): see jsontext
            json_serializer=jsontext.dumps,
            json_deserializer=jsontext.loads,
        )
        event.listen(
            self.engine,
            "connect",
            functools.partial(_set_session_defaults, idle_tx_timeout_ms=_ms(idle_tx_timeout_s)),
        )
        self._sessions = sessionmaker(self.engine, expire_on_commit=False, autoflush=True)

    def describe(self) -> str:
        """Where the database is, with any password masked."""
        if self.target.embedded:
            return self.target.describe()
        return self.url.render_as_string(hide_password=True)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Tx]:
        """Commit on normal exit, roll back on any exception (nothing half-written)."""
        with self._sessions() as session, session.begin():
            yield _tx(session)

    @contextlib.contextmanager
    def migration_connection(self) -> Iterator[Connection]:
        """A connection for migrations: the embedded server's migrator (its sessions' runtime
        role may not run DDL); for an external database, the URL given (its operator runs
        ``rollcall db upgrade`` with the migration role's)."""
        if self.migration_url is None:
            with self.engine.connect() as conn:
                yield conn
            return
        engine = create_engine(
            self.migration_url,
            poolclass=NullPool,
            connect_args={"application_name": APPLICATION_NAME, "connect_timeout": 10},
        )
        try:
            with engine.connect() as conn:
                yield conn
        finally:
            engine.dispose()

    @contextlib.contextmanager
    def autocommit(self) -> Iterator[Tx]:
        """Repositories on a connection in autocommit mode: every statement is its own
        transaction. For single-statement operations whose locks must be released the moment
        the statement ends (claims)."""
        with self.engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            with Session(bind=conn) as session:
                yield _tx(session)

    def check_connection(self) -> None:
        try:
            with self.engine.connect() as conn:
                conn.exec_driver_sql("SELECT 1")
        except OperationalError as e:
            tls = tls_failure(e, self.url)
            if tls is not None:
                raise DatabaseUnavailableError(f"cannot connect to the database: {tls}") from None
            reason = str(e.orig).strip().splitlines()[0] if e.orig else "connection failed"
            raise DatabaseUnavailableError(
                f"cannot connect to the database at {self.describe()}: {reason}"
            ) from None

    def verify_schema(self) -> None:

        with self.engine.connect() as conn:
            verify_at_head(conn)

    def dispose(self) -> None:
        self.engine.dispose()


def _tx(session: Session) -> Tx:
    return Tx(
        session=session,
        jobs=JobRepository(session),
        tasks=TaskRepository(session),
        events=EventRepository(session),
        episodes=EpisodeRepository(session),
        trajectories=TrajectoryRepository(session),
        batches=BatchRepository(session),
        workers=WorkerRepository(session),
        invariants=InvariantRepository(session),
        monitoring=MonitoringRepository(session),
        fleet=FleetRepository(session),
        history=HistoryRepository(session),
    )


def _ms(seconds: float) -> int:
    if seconds <= 0:
        raise ValueError(f"idle_tx_timeout_s must be positive, not {seconds:g}")
    return max(1, round(seconds * 1000))


def _set_session_defaults(dbapi_conn: object, _record: object, *, idle_tx_timeout_ms: int) -> None:
    # Keep a stuck statement from holding locks forever; long scans are not in the hot path.
    # A session idle inside a transaction longer than the timeout is ended by the server (see
    # IDLE_TX_TIMEOUT_S); its client's next statement fails and the retry layer reconnects.
    cur = dbapi_conn.cursor()  # type: ignore[attr-defined]
    cur.execute("SET lock_timeout = '30s'")
    cur.execute(f"SET idle_in_transaction_session_timeout = {int(idle_tx_timeout_ms)}")
    cur.close()
    dbapi_conn.commit()  # type: ignore[attr-defined]


def open_database(
    explicit_url: str | None = None,
    config_url: str | None = None,
    *,
    home: str | Path | None = None,
    verify_schema: bool = True,
    pool_size: int = 5,
    max_overflow: int | None = None,
    idle_tx_timeout_s: float = IDLE_TX_TIMEOUT_S,
) -> Database:
    """Resolve, (start,) connect and, unless told otherwise, verify the schema is at head."""
    target = resolve_database(explicit_url, config_url, home)
    migration_url = None
    if target.url is None:
        server = EmbeddedPostgres(target.home)
        raw = server.ensure_running()  # the runtime role's
        migration_url = normalise_url(server.url(role=MIGRATOR))
    else:
        raw = target.url
    db = Database(
        normalise_url(raw),
        target,
        pool_size=pool_size,
        max_overflow=max_overflow,
        idle_tx_timeout_s=idle_tx_timeout_s,
        migration_url=migration_url,
    )
    try:
        db.check_connection()
        if verify_schema:
            db.verify_schema()
    except BaseException:
        db.dispose()
        raise
    return db
