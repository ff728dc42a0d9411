"""Jobs: creation and lookup by name."""

from __future__ import annotations

import getpass
from typing import Any

from orchestrator.config import check_name
from orchestrator.db.engine import Tx
from orchestrator.domain import JobView
from orchestrator.errors import NotFoundError, UserError

DEFAULT_JOB = "default"


def operator_actor() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"operator:{user}"


def require_job(tx: Tx, name: str) -> JobView:
    job = tx.jobs.get_by_name(name)
    if job is None:
        hint = (
            "run `rollcall db upgrade` to create it"
            if name == DEFAULT_JOB
            else f"create it with `rollcall job create {name}` or pass an existing --job"
        )
        raise NotFoundError(f"job {name!r} does not exist; {hint}")
    return job


def create_job(tx: Tx, name: str, *, config: dict[str, Any] | None = None, actor: str) -> JobView:
    try:
        check_name(name, "job name")
    except ValueError as e:
        raise UserError(str(e)) from None
    job = tx.jobs.create(name, config)
    tx.events.add("job.created", actor, f"job {name!r} created", job_id=job.id)
    return job
