"""Jobs: creation and lookup by name; stop requests and what operators see of the driver."""

from __future__ import annotations

import getpass
from typing import Any

from rollcall.orchestrator.config import check_name
from rollcall.orchestrator.db.engine import Tx
from rollcall.orchestrator.domain import JobStatus, JobView
from rollcall.orchestrator.errors import ConflictError, NotFoundError, UserError

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


def request_stop(tx: Tx, name: str, *, actor: str) -> bool:
    """Ask the job's driver to stop (``rollcall job stop``): the job becomes ``stopping``, which
    its driver sees within a second. False when a stop was already requested. Refused when no
    driver runs the job."""
    job = require_job(tx, name)
    if not tx.jobs.driver_alive(job.id):
        raise ConflictError(
            f"job {name!r} has no running driver (status {job.status.value}), so there is "
            "nothing to stop; `rollcall run CONFIG --resume` continues it"
        )
    if job.status is JobStatus.STOPPING:
        return False
    if not tx.jobs.request_stop(job.id):
        raise ConflictError(
            f"job {name!r} is {job.status.value}, not running: its driver is still starting; "
            f"run `rollcall job stop {name}` again in a moment"
        )
    tx.events.add(
        "job.stop_requested",
        actor,
        f"stop of job {name!r} requested; its driver finishes the step in progress",
        job_id=job.id,
    )
    return True


MAX_ROLLOUT_NODES = 4096


def scale(tx: Tx, name: str, rollout_nodes: int, *, actor: str) -> int:
    """Set the rollout nodes a running job should have (``rollcall job scale``); its driver's
    supervisor adds slots (placed where Ray has room, or waiting for it) or drains the extra
    ones (their in-flight turns checkpointed, their leases given back) within seconds. Returns
    the previous size. Refused for a job no driver runs (``rollout.nodes`` sets the size of
    its next run) and for a size below 1."""
    job = require_job(tx, name)
    if not 1 <= rollout_nodes <= MAX_ROLLOUT_NODES:
        raise UserError(
            f"--rollout-nodes must be between 1 and {MAX_ROLLOUT_NODES}, got {rollout_nodes}; "
            f"`rollcall job stop {name}` stops the job instead"
        )
    if not tx.jobs.driver_alive(job.id) or job.status is not JobStatus.RUNNING:
        raise ConflictError(
            f"job {name!r} is not running (status {job.status.value}), so there is no fleet "
            "to scale; set rollout.nodes when you continue it with `rollcall run CONFIG "
            "--resume`"
        )
    before = tx.fleet.size(job.id) or 0
    tx.fleet.set_size(job.id, rollout_nodes)
    tx.events.add(
        "job.scaled",
        actor,
        f"job {name!r} scaled from {before} to {rollout_nodes} rollout nodes",
        job_id=job.id,
        payload={"from": before, "to": rollout_nodes},
    )
    return before


def describe_driver(info: dict[str, Any] | None) -> str:
    """``pid 123 on host h, started 2026-01-31 12:00:00``, from ``jobs.driver``."""
    if not info:
        return "a driver whose details are not recorded"
    text = f"pid {info.get('pid')} on {info.get('host')}"
    if started := info.get("started_at"):
        text += f", started {str(started)[:19].replace('T', ' ')}"
    return text


def driver_json(job: JobView, alive: bool) -> dict[str, Any]:
    info = job.driver or {}
    return {
        "alive": alive,
        "epoch": job.driver_epoch,
        "pid": info.get("pid"),
        "host": info.get("host"),
        "started_at": info.get("started_at"),
    }


def driver_line(job: JobView, alive: bool) -> str | None:
    """One line on the job's driver for ``job show`` (None: the job never had one)."""
    if not job.driver:
        return None
    who = describe_driver(job.driver)
    if alive:
        return f"driver: {who} (epoch {job.driver_epoch}), running"
    if job.status in (JobStatus.RUNNING, JobStatus.STOPPING):
        return (
            f"driver: none alive; the last one ({who}) ended without recording its end "
            "(killed?); `rollcall run CONFIG --resume` continues the job"
        )
    return f"driver: none; the last one was {who}"
