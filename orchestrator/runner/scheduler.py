"""The job driver's control-plane scheduler (APScheduler): its jobs run on the scheduler's
threads, late runs are tolerated, piled-up runs coalesce, and what it logs goes to the run
directory's driver.log."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

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


def make_scheduler() -> tuple[Any, Any]:
    """A background scheduler with the control plane's job defaults (not started), and its
    dropped runs' count (``metrics.MissedRuns``)."""
    from apscheduler.schedulers.background import BackgroundScheduler

    from rollcall.orchestrator.runner.metrics import MissedRuns

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
