"""The one retry policy for database work: capped exponential backoff with full jitter.

``retry_transient`` wraps an operation that opens its own transaction (a ``Buffer`` method):
when the database is unreachable or the connection broke (a restart, a failover), the whole
operation runs again, on a fresh connection, until ``window_s`` has passed. The caller's
arguments, and so any finished work it carries (a trajectory to commit), stay in memory across
the attempts. Errors that are not about connectivity (a constraint, a stale lease) surface at
once. Every retried write is idempotent or fenced: a commit whose first attempt did land is
recognised on the second; a claim whose answer was lost leaves a lease that expires and is
requeued.

An instance with an ``outages`` attribute (an ``OutageTracker``: the ``Buffer``'s) is told of
every transient failure and every success: the first failure opens an outage, the first success
after it closes it, and the closed outage is handed once to the instance's
``_outage_ended(outage)``. One outage is reported once, however many calls rode it out.

Two helpers for connections made outside SQLAlchemy's pool: ``libpq_conninfo`` (the connection
string of a URL) and ``tls_failure`` (what a connection refused over TLS, or for want of it,
says to the user, in one sentence).
"""

from __future__ import annotations

import functools
import logging
import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import psycopg
from psycopg.conninfo import make_conninfo
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_WINDOW_S = 30.0
# A bounded pool (a rollout node's) whose connections are all in use: the database answers,
# the caller waits its turn. Not an outage, and not limited by the retry window; this bounds it.
POOL_WAIT_S = 600.0
BASE_S = 0.1
CAP_S = 5.0
# After an outage closed, failures for this long still belong to it (connections that broke
# with the old server fail on their first use after the restart): they open no new outage.
SETTLE_S = CAP_S


def is_transient(e: BaseException) -> bool:
    """A failure to reach or keep talking to the database (not a failure of the SQL)."""
    if isinstance(e, sa_exc.DBAPIError) and e.connection_invalidated:
        return True
    if isinstance(e, sa_exc.OperationalError | sa_exc.InterfaceError):
        return True
    if isinstance(e, psycopg.OperationalError | psycopg.InterfaceError):
        return True
    return isinstance(e, sa_exc.TimeoutError)  # pool exhausted while connections reconnect


def libpq_conninfo(url: URL) -> str:
    """libpq's connection string for ``url``, its query parameters included (``sslmode``,
    ``sslrootcert``, a socket ``host``). Built from the parts, not by rendering the URL: libpq
    reads a ``+`` in a URL as a plus, and SQLAlchemy writes a space as one."""
    args = url.translate_connect_args(username="user", database="dbname")
    params = {k: v for k, v in args.items() if v is not None}
    for key, value in url.query.items():
        params[key] = value if isinstance(value, str) else ",".join(value)  # several hosts
    return make_conninfo("", **params)


_HOST_MISMATCH = re.compile(r'server certificate for .*? does not match host name "[^"]*"')
_NO_ROOT_FILE = re.compile(r'root certificate file "[^"]*" does not exist')
_NO_PLAINTEXT = re.compile(r"no pg_hba\.conf entry for [^\n]*?, no encryption")


def tls_failure(error: BaseException, url: URL) -> str | None:
    """One sentence, naming the server, for a connection that TLS refused (the server's
    certificate not verified against ``sslrootcert``, or not naming the host; no CA file) or
    that the server refused for want of TLS; None for any other failure."""
    text = str(getattr(error, "orig", None) or error)
    host = url.host or _param(url, "host") or os.environ.get("PGHOST") or "localhost"
    port = url.port or _param(url, "port") or os.environ.get("PGPORT") or "5432"
    server = f"the database server at {host}:{port}"
    mode = _param(url, "sslmode") or os.environ.get("PGSSLMODE") or "prefer"
    if "certificate verify failed" in text:
        root = (
            _param(url, "sslrootcert")
            or os.environ.get("PGSSLROOTCERT")
            or "~/.postgresql/root.crt (libpq's default)"
        )
        return (
            f"the TLS certificate of {server} was not verified against sslrootcert {root} "
            "(certificate verify failed); sslrootcert must hold the CA certificate that signed "
            "the server's certificate"
        )
    if m := _HOST_MISMATCH.search(text):
        return (
            f"the TLS certificate of {server} does not name that host ({m[0]}); connect by a "
            f"name the certificate lists, as sslmode={mode} checks it"
        )
    if m := _NO_ROOT_FILE.search(text):
        return (
            f"sslmode={mode} verifies {server} against a CA certificate, and the {m[0]} on "
            "this machine; copy the CA file here or point sslrootcert at it"
        )
    if m := _NO_PLAINTEXT.search(text):
        return (
            f"{server} refused an unencrypted connection ({m[0]}); if it accepts only TLS "
            "(hostssl in pg_hba.conf), connect with sslmode=verify-full and sslrootcert"
        )
    return None


def _param(url: URL, key: str) -> str | None:
    value = url.query.get(key)
    if value is None or isinstance(value, str):
        return value
    return ",".join(value)


def backoff_s(attempt: int, *, base_s: float = BASE_S, cap_s: float = CAP_S) -> float:
    """Full jitter: uniform in [0, min(cap, base * 2^attempt)]."""
    return random.uniform(0.0, min(cap_s, base_s * (2**attempt)))


def retry_transient(fn: F) -> F:
    """Retry ``fn`` on transient database errors for ``self.retry_window_s`` seconds (the
    instance's, else 30 s)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        window = float(getattr(args[0], "retry_window_s", DEFAULT_WINDOW_S)) if args else 0.0
        tracker: OutageTracker | None = getattr(args[0], "outages", None) if args else None
        deadline = time.monotonic() + window
        pool_deadline = time.monotonic() + POOL_WAIT_S
        attempt = 0
        while True:
            try:
                result = fn(*args, **kwargs)
            except Exception as e:
                if not is_transient(e):
                    raise
                if isinstance(e, sa_exc.TimeoutError) and time.monotonic() < pool_deadline:
                    # every pooled connection is in use (each wait took the pool's timeout)
                    log.info("%s: waiting for a free database connection", fn.__qualname__)
                    deadline = max(deadline, time.monotonic() + window)
                    continue
                if tracker is not None:
                    tracker.failed(fn.__qualname__, e)
                if time.monotonic() >= deadline:
                    raise
                delay = min(backoff_s(attempt), max(0.0, deadline - time.monotonic()))
                log.warning(
                    "%s: database unavailable (%s); retry %d in %.2f s",
                    fn.__qualname__,
                    type(e).__name__,
                    attempt + 1,
                    delay,
                )
                time.sleep(delay)
                attempt += 1
            else:
                if tracker is not None and tracker.pending:
                    _report(args[0], tracker)
                return result

    return wrapper  # type: ignore[return-value]


@dataclass(frozen=True)
class Outage:
    """What one process saw of one database outage."""

    began_at: float  # Unix time of the first failed call
    ended_at: float  # Unix time of the first call that went through again
    duration_s: float
    failures: int  # failed attempts, all calls together
    operations: dict[str, int]  # failed attempts by operation (``Buffer.beat``: 12)
    error: str  # the first failure's exception type

    def describe(self) -> str:
        ops = ", ".join(f"{op} {n}" for op, n in sorted(self.operations.items()))
        return (
            f"database unavailable for {self.duration_s:.1f} s, back now; attempts retried: "
            f"{ops} (first error: {self.error})"
        )

    def payload(self) -> dict[str, Any]:
        return {
            "began_at": _iso(self.began_at),
            "ended_at": _iso(self.ended_at),
            "duration_s": round(self.duration_s, 3),
            "failures": self.failures,
            "operations": dict(self.operations),
            "error": self.error,
        }


class OutageTracker:
    """The outages of the database as the calls of one object (a ``Buffer``) see them.
    Thread-safe; a success costs an attribute read unless an outage is open."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.failures = 0  # transient failures ever seen (the sweeps compare it)
        self._began: tuple[float, float] | None = None  # (unix, monotonic) of the open outage
        self._ops: Counter[str] = Counter()
        self._error = ""
        self._closed_at: float | None = None  # monotonic, of the last close
        # failures within SETTLE_S of a close: (unix, monotonic) of the first, by operation
        self._tail: tuple[float, float] | None = None
        self._tail_ops: Counter[str] = Counter()
        self._unreported: list[Outage] = []
        self.pending = False  # an outage is open, or closed and not reported yet

    def failed(self, operation: str, error: BaseException) -> None:
        now = self._clock()
        with self._lock:
            self.failures += 1
            if self._began is None:
                if self._closed_at is not None and now - self._closed_at < SETTLE_S:
                    # the tail of the outage that just closed, unless the failures go on
                    self._tail = self._tail or (time.time(), now)
                    self._tail_ops[operation] += 1
                    self.pending = True  # the next success ends the tail
                    return
                self._began = self._tail or (time.time(), now)
                self._ops, self._tail, self._tail_ops = self._tail_ops, None, Counter()
                self._error = type(error).__name__
            self._ops[operation] += 1
            self.pending = True

    def take(self) -> list[Outage]:
        """After a call went through: close the open outage; every closed outage not yet
        reported (each is handed out once)."""
        now = self._clock()
        with self._lock:
            if self._began is not None:
                began, began_mono = self._began
                self._unreported.append(
                    Outage(
                        began_at=began,
                        ended_at=time.time(),
                        duration_s=now - began_mono,
                        failures=sum(self._ops.values()),
                        operations=dict(self._ops),
                        error=self._error,
                    )
                )
                self._began = None
                self._closed_at = now
            self._tail, self._tail_ops = None, Counter()
            out, self._unreported = self._unreported, []
            self.pending = False
            return out

    def put_back(self, outage: Outage) -> None:
        """An outage whose report failed: handed out again after the next success."""
        with self._lock:
            self._unreported.append(outage)
            self.pending = True


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")


def _report(instance: Any, tracker: OutageTracker) -> None:
    report = getattr(instance, "_outage_ended", None)
    for outage in tracker.take():
        if report is None:
            log.warning("%s", outage.describe())
            continue
        try:
            report(outage)
        except Exception:
            log.warning("could not record the end of an outage; will try again", exc_info=True)
            tracker.put_back(outage)
