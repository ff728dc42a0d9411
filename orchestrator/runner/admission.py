"""Whether a run of a job may start: refused when the job does not exist with ``--resume``,
when it already trained without it, and when another driver runs it (after waiting out a
driver killed a moment ago on this machine). The driver lock (``lifecycle.py``) decides in the
end; these checks refuse what they can before Ray starts."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from rollcall.orchestrator import procfs
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.errors import ConflictError, NotFoundError
from rollcall.orchestrator.runner.lifecycle import refuse

# how long a new run waits for the driver lock of a driver that was just killed to go
DRIVER_GONE_GRACE_S = 10.0
POLL_S = 0.25  # how often it looks meanwhile


def refusal(tx: Any, job: Any, name: str, *, resume: bool, early: bool = False) -> int | None:
    """Refuse a run of a job that does not exist with --resume and of a job that already
    trained without it. ``early`` (before Ray starts; the driver lock decides later):
    the id of the job when another driver runs it, for the caller to refuse."""
    if job is None and resume:
        raise NotFoundError(
            f"job {name!r} does not exist, so there is nothing to resume; drop --resume to start it"
        )
    if job is None:
        return None
    if early and tx.jobs.driver_alive(job.id):
        return int(job.id)
    if not resume and job.policy_version > 0:
        raise ConflictError(
            f"job {name!r} already trained {job.policy_version} steps; pass --resume to "
            "continue it, or set job.name to start a new job"
        )
    return None


def refuse_early(db: Database, name: str, *, resume: bool, actor: str) -> None:
    """What refuses a run of job ``name`` without Ray (checked again under the lock)."""
    with db.transaction() as tx:
        job = tx.jobs.get_by_name(name)
        running = refusal(tx, job, name, resume=resume, early=True)
        holder = dict(job.driver or {}) if job is not None else {}
    # A driver killed a moment ago holds its lock until PostgreSQL sees its connection
    # close (its backend reads the end of the socket, and may wait for a CPU to do so): a
    # run restarted at once on its machine (a supervisor's) waits that out instead of
    # being refused; a driver alive, or on another machine, is refused at once.
    gone = holder.get("host") == socket.gethostname() and not procfs.alive(
        int(holder.get("pid") or 0)
    )
    deadline = time.monotonic() + DRIVER_GONE_GRACE_S
    while running is not None and gone and time.monotonic() < deadline:
        time.sleep(POLL_S)
        with db.transaction() as tx:
            running = running if tx.jobs.driver_alive(running) else None
    if running is not None:  # another driver runs it (the lock would refuse this one)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "actor": actor}
        raise refuse(db, running, name, actor, info)
