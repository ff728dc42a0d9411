"""Wake-ups for the trainer's loop: PostgreSQL LISTEN/NOTIFY on "a group is complete".

A rollout node that completes a group notifies the job's channel in the same transaction
(``BatchRepository.notify_group_done``; PostgreSQL delivers it when that transaction commits).
The job driver, waiting for a full batch, listens on its own connection and claims again as
soon as a group lands, instead of sleeping a poll period. Notifications are only a hint: the
claim decides, and a notification lost to a dropped connection costs at most the caller's
timeout (the driver then claims anyway), so nothing depends on their delivery.
"""

from __future__ import annotations

import contextlib
import logging
import time

import psycopg
from sqlalchemy.engine import URL

from rollcall.orchestrator.db.retry import libpq_conninfo

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 5


def groups_channel(job_id: int) -> str:
    """The job's channel (an identifier: the job id is an integer)."""
    return f"rollcall_groups_{int(job_id)}"


class GroupsListener:
    """``wait(timeout_s, count)`` returns True as soon as ``count`` groups of the job completed
    (default one), False after ``timeout_s`` with fewer. The connection is opened on first use
    and reopened after a failure (e.g. a database restart); while the database is unreachable
    ``wait`` sleeps its timeout and returns False."""

    def __init__(self, url: URL, job_id: int, *, application_name: str = "rollcall-listen") -> None:
        self._conninfo = libpq_conninfo(url)
        self._channel = groups_channel(job_id)
        self._application_name = application_name
        self._conn: psycopg.Connection | None = None
        self.wakeups = 0  # waits ended by notifications (for tests and benchmarks)

    def _connection(self) -> psycopg.Connection | None:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        try:
            conn = psycopg.connect(
                self._conninfo,
                autocommit=True,
                connect_timeout=CONNECT_TIMEOUT_S,
                application_name=self._application_name,
            )
            conn.execute(f"LISTEN {self._channel}")
        except psycopg.Error as e:
            log.debug("LISTEN %s failed: %s", self._channel, e)
            return None
        self._conn = conn
        return conn

    def wait(self, timeout_s: float, count: int = 1) -> bool:
        """True once ``count`` groups completed (a batch that lacked that many may be full
        now), False after ``timeout_s`` with fewer."""
        start = time.monotonic()
        conn = self._connection()
        if conn is None:
            time.sleep(max(0.0, timeout_s - (time.monotonic() - start)))
            return False
        want = max(1, count)
        try:
            got = sum(1 for _ in conn.notifies(timeout=max(0.0, timeout_s), stop_after=want))
            if got >= want:
                self.wakeups += 1
                return True
        except psycopg.Error as e:
            log.debug("waiting on %s failed: %s", self._channel, e)
            self.close()
            time.sleep(max(0.0, timeout_s - (time.monotonic() - start)))
        return False

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
