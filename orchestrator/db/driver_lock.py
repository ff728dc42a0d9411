"""One driver per job: a PostgreSQL session-level advisory lock, on a connection of its own.

A driver holds the lock on (``DRIVER_LOCK_NS``, job id) for its whole life; a second driver of
the same job fails ``pg_try_advisory_lock`` and is refused. The lock dies with its session, so
a driver that crashed or was killed (its connection closed by the kernel) never blocks the next
``--resume``; for a driver whose machine vanished, server-side TCP keepalives end the session
within about ``KEEPALIVE_S``.

A database restart also ends the session, and so the lock, under a healthy driver: ``check()``
then reconnects and takes it again. In the moment between, a second driver could take it
first; the driver epoch in the jobs row (bumped by every driver that takes the job, and checked
by every step commit) is what makes that safe: the old driver's next commit is refused, and its
``check()`` sees the new epoch and stops it.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import psycopg
from sqlalchemy.engine import URL

from rollcall.orchestrator.db.retry import libpq_conninfo, tls_failure
from rollcall.orchestrator.errors import DatabaseUnavailableError

log = logging.getLogger(__name__)

DRIVER_LOCK_NS = 0x52434456  # "RCDV"; must differ from the per-job batch lock's namespace
CONNECT_TIMEOUT_S = 5
STATEMENT_TIMEOUT_MS = 10_000
KEEPALIVE_S = 30  # idle 10 s, then 4 probes 5 s apart
_SERVER_OPTIONS = (
    f"-c statement_timeout={STATEMENT_TIMEOUT_MS} -c idle_session_timeout=0 "
    "-c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=4"
)


@dataclass(frozen=True)
class LockCheck:
    """One look at the lock and the job row. ``reachable`` False: the database could not be
    reached (``held`` is then unknown and False). ``retaken``: the connection had dropped and
    the lock was taken again just now. ``status`` and ``epoch``: the job row's."""

    reachable: bool
    held: bool
    retaken: bool = False
    status: str | None = None
    epoch: int | None = None


class DriverLock:
    def __init__(self, url: URL, job_id: int, *, application_name: str = "rollcall-driver"):
        self._url = url
        self._conninfo = libpq_conninfo(url)
        self.job_id = int(job_id)
        self._application_name = application_name[:63]
        self._conn: psycopg.Connection | None = None
        self.held = False

    def _connect(self) -> psycopg.Connection:
        return psycopg.connect(
            self._conninfo,
            autocommit=True,
            connect_timeout=CONNECT_TIMEOUT_S,
            application_name=self._application_name,
            options=_SERVER_OPTIONS,
            keepalives=1,
            keepalives_idle=10,
            keepalives_interval=5,
            keepalives_count=4,
        )

    def _try_lock(self, conn: psycopg.Connection) -> bool:
        row = conn.execute(
            "SELECT pg_try_advisory_lock(%s, %s)", (DRIVER_LOCK_NS, self.job_id)
        ).fetchone()
        return bool(row and row[0])

    def acquire(self) -> bool:
        """Take the lock; False when another session holds it."""
        if self.held:
            return True
        try:
            conn = self._conn if self._conn is not None and not self._conn.closed else None
            if conn is None:
                conn = self._conn = self._connect()
            self.held = self._try_lock(conn)
        except psycopg.OperationalError as e:
            self.close()
            reason = str(e).strip().splitlines()[0] if str(e).strip() else "connection failed"
            raise DatabaseUnavailableError(
                "cannot take the job's driver lock: "
                + (tls_failure(e, self._url) or f"the database is unreachable ({reason})")
            ) from None
        return self.held

    def check(self) -> LockCheck:
        """Is the lock still held (its session alive)? If the session was lost (a database
        restart), reconnect and take the lock again. Also reads the job row's status and
        driver epoch. Never raises for connectivity."""
        conn = self._conn
        if conn is not None and not conn.closed:
            try:
                retaken = not self.held and self._try_lock(conn)
                self.held = self.held or retaken
                return self._read(conn, held=self.held, retaken=retaken)
            except psycopg.Error as e:
                log.warning("driver lock of job %s: connection lost (%s)", self.job_id, e)
        self.close()
        try:
            conn = self._conn = self._connect()
            self.held = self._try_lock(conn)
            return self._read(conn, held=self.held, retaken=self.held)
        except psycopg.Error as e:
            log.debug("driver lock of job %s: database unreachable (%s)", self.job_id, e)
            self.close()
            return LockCheck(reachable=False, held=False)

    def _read(self, conn: psycopg.Connection, *, held: bool, retaken: bool = False) -> LockCheck:
        row = conn.execute(
            "SELECT status::text, driver_epoch FROM jobs WHERE id = %s", (self.job_id,)
        ).fetchone()
        status, epoch = (row[0], int(row[1])) if row else (None, None)
        return LockCheck(True, held, retaken, status, epoch)

    def close(self) -> None:
        """Release the lock (by ending its session)."""
        conn, self._conn = self._conn, None
        self.held = False
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
