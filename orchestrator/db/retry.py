"""The one retry policy for database work: capped exponential backoff with full jitter.

``retry_transient`` wraps an operation that opens its own transaction (a ``Buffer`` method):
when the database is unreachable or the connection broke (a restart, a failover), the whole
operation runs again, on a fresh connection, until ``window_s`` has passed. The caller's
arguments, and so any finished work it carries (a trajectory to commit), stay in memory across
the attempts. Errors that are not about connectivity (a constraint, a stale lease) surface at
once. Every retried write is idempotent or fenced: a commit whose first attempt did land is
recognised on the second; a claim whose answer was lost leaves a lease that expires and is
requeued.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from sqlalchemy import exc as sa_exc

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_WINDOW_S = 30.0
BASE_S = 0.1
CAP_S = 5.0


def is_transient(e: BaseException) -> bool:
    """A failure to reach or keep talking to the database (not a failure of the SQL)."""
    if isinstance(e, sa_exc.DBAPIError) and e.connection_invalidated:
        return True
    if isinstance(e, sa_exc.OperationalError | sa_exc.InterfaceError):
        return True
    if isinstance(e, psycopg.OperationalError | psycopg.InterfaceError):
        return True
    return isinstance(e, sa_exc.TimeoutError)  # pool exhausted while connections reconnect


def backoff_s(attempt: int, *, base_s: float = BASE_S, cap_s: float = CAP_S) -> float:
    """Full jitter: uniform in [0, min(cap, base * 2^attempt)]."""
    return random.uniform(0.0, min(cap_s, base_s * (2**attempt)))


def retry_transient(fn: F) -> F:
    """Retry ``fn`` on transient database errors for ``self.retry_window_s`` seconds (the
    instance's, else 30 s)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        window = float(getattr(args[0], "retry_window_s", DEFAULT_WINDOW_S)) if args else 0.0
        deadline = time.monotonic() + window
        attempt = 0
        while True:
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                if not is_transient(e) or time.monotonic() >= deadline:
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

    return wrapper  # type: ignore[return-value]
