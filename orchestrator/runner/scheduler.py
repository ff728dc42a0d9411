"""The job driver's control-plane scheduler (APScheduler): its jobs run on the scheduler's
threads, late runs are tolerated, piled-up runs coalesce, and what it logs goes to the run
directory's driver.log."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rollcall.orchestrator.runner.metrics import MissedRuns

if TYPE_CHECKING:
    from rollcall.orchestrator.buffer.control import ControlPlaneBuffer
    from rollcall.orchestrator.config import RollcallConfig
    from rollcall.orchestrator.runner.supervisor import Supervisor
    from rollcall.orchestrator.runner.usererrors import UserErrorReport

# A control-plane run that starts late (a loaded machine) still runs unless it is this late
# (the process was frozen): then it is dropped, logged to driver.log and counted.
MISFIRE_GRACE_S = 60
# Every control-plane job: runs that piled up while the process was busy run once, not in a
# burst (coalesce); a pass is skipped while the previous one of the same job still runs.
SCHEDULER_JOB_DEFAULTS = {
    "misfire_grace_time": MISFIRE_GRACE_S,
    "coalesce": True,
    "max_instances": 1,
}


class _SkippedRunFilter(logging.Filter):
    """Drops APScheduler's warning that a run was skipped because the previous one of the same
    job is still running; everything else it logs passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "maximum number of running instances reached" not in record.getMessage()


SKIPPED_RUN_FILTER = _SkippedRunFilter()
# How often the driver reads the nodes' new user-code failures (orchestrator/runner/usererrors)
USER_ERRORS_INTERVAL_S = 1.0


def make_scheduler() -> tuple[Any, Any]:
    """A background scheduler with the control plane's job defaults (not started), and its
    dropped runs' count (``metrics.MissedRuns``)."""
    from apscheduler.schedulers.background import BackgroundScheduler

    # A pass that overlaps the previous one of the same job is skipped by design
    # (max_instances=1: e.g. supervision while a node starts); APScheduler warns about
    # each skip, which is noise here.
    logging.getLogger("apscheduler.scheduler").addFilter(SKIPPED_RUN_FILTER)  # once
    s = BackgroundScheduler(daemon=True, job_defaults=SCHEDULER_JOB_DEFAULTS)
    return s, MissedRuns(s)


def start_jobs(s: Any, jobs: Sequence[tuple[Callable[[], Any], float, str]]) -> None:
    """Add each (function, interval in seconds, name) as an interval job, then start."""
    for fn, every, name in jobs:
        s.add_job(fn, "interval", seconds=every, id=name)
    s.start()


def control_plane_jobs(
    cfg: RollcallConfig,
    control: ControlPlaneBuffer,
    *,
    supervisor: Callable[[], Supervisor | None],
    user_errors: Callable[[], UserErrorReport | None],
    say: Callable[[str], None],
    ray_logs: Callable[[], Any] | None = None,
) -> list[tuple[Callable[[], Any], float, str]]:
    """The driver's control-plane jobs (function, interval in seconds, name): seeding, the
    lease sweep, staleness expiry, the dead-worker sweep, the rollout nodes' supervision (a job
    of its own, so it never waits on the driver's loop: a trainer call may take up to
    ``trainer.call_timeout_s``), retention, the report of user-code failures and, given
    ``ray_logs`` (``sessionlogs.pruner``: a local Ray the driver started), the pruning of its
    exited workers' log files at the retention interval.
    ``supervisor`` and ``user_errors`` are read at each run (set up after the scheduler)."""
    cp = cfg.control_plane

    def sweep_dead() -> None:
        for d in control.sweep_dead_workers(cp.heartbeat_timeout_s, cp.progress_timeout_s):
            say(f"{d.name}: declared dead ({d.reason}); {d.swept.requeued} leases requeued")

    def supervise() -> None:
        if (sup := supervisor()) is not None:
            sup.check()

    def retention() -> None:
        """Old payloads (``buffer.payload_retention_*``), old steps' metadata
        (``buffer.metadata_retention_steps``), then old events
        (``control_plane.event_retention_*``)."""
        control.drop_old_payloads()
        control.compact_metadata()
        control.drop_old_events(cp.event_retention_s, cp.event_retention_count)

    def report_user_errors() -> None:
        if (report := user_errors()) is not None:
            report.poll()

    jobs: list[tuple[Callable[[], Any], float, str]] = [
        (control.seed, cp.seed_interval_s, "seed"),
        (control.sweep_expired_leases, cp.lease_sweep_interval_s, "lease-sweep"),
        (control.expire_stale, cp.staleness_interval_s, "staleness-expiry"),
        (sweep_dead, cp.dead_sweep_interval_s, "dead-worker-sweep"),
        (supervise, cp.supervise_interval_s, "supervise"),
        (retention, cp.retention_interval_s, "payload-retention"),
        (report_user_errors, USER_ERRORS_INTERVAL_S, "user-errors"),
    ]
    if ray_logs is not None:
        jobs.append((ray_logs, cp.retention_interval_s, "ray-log-prune"))
    return jobs
