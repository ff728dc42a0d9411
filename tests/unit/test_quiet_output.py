"""A run's terminal shows rollcall's lines only: while the run lasts, Python's warnings (a
library's FutureWarning, a deprecation) and library log records go to the run directory's
``driver.log``; afterwards warnings print as before. The control plane's scheduler jobs run
late rather than being dropped on a busy machine, and once when several runs piled up.

The capture runs in a child process (no logging or warnings set up by a test harness), so what
reaches its stderr is what a user would see."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rollcall.orchestrator.config import RollcallConfig
from rollcall.orchestrator.runner.driver import JobDriver
from rollcall.orchestrator.runner.rundir import RunDir
from rollcall.orchestrator.runner.scheduler import MISFIRE_GRACE_S

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, logging, sys, warnings
from pathlib import Path

from rollcall.orchestrator.runner.rundir import RunDir

before = warnings.showwarning
release = RunDir(Path(sys.argv[1])).capture_logs()
warnings.warn("gradient_checkpointing_enable inside the run", FutureWarning)
logging.getLogger("apscheduler.executors.default").warning(
    'Run time of job "seed" was missed by 0:01:02'
)
release()
warnings.warn("a warning after the run", FutureWarning)
print(json.dumps({"restored": warnings.showwarning is before}))
"""


def test_warnings_and_library_logs_go_to_driver_log_while_the_run_lasts(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "default"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "inside the run" not in proc.stderr and "was missed by" not in proc.stderr
    assert "FutureWarning: a warning after the run" in proc.stderr  # printed as before
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"restored": True}
    log = (tmp_path / "driver.log").read_text()
    assert "WARNING py.warnings" in log
    assert "FutureWarning: gradient_checkpointing_enable inside the run" in log
    assert 'Run time of job "seed" was missed by 0:01:02' in log
    assert "after the run" not in log


class _Buffer:  # the control plane's calls, doing nothing
    record_outages = False
    on_outage: Any = None

    def seed(self) -> dict[str, Any]:
        return {}

    def sweep_expired_leases(self) -> None:
        return None

    def expire_stale(self) -> dict[str, Any]:
        return {}

    def sweep_dead_workers(self, *args: Any) -> list[Any]:
        return []

    def drop_old_payloads(self) -> tuple[int, int]:
        return 0, 0

    def drop_old_events(self, *args: Any) -> int:
        return 0


def test_scheduler_jobs_coalesce_and_tolerate_a_busy_machine(tmp_path: Path) -> None:
    driver = JobDriver(
        RollcallConfig.model_validate({"job": {"name": "quiet"}}),
        None,  # type: ignore[arg-type]  # the scheduler alone needs no database
        model_dir=tmp_path,
        home=tmp_path,
        live=False,
    )
    driver.control_buffer = _Buffer()  # type: ignore[assignment]
    driver.run_dir = RunDir(tmp_path / "run")
    try:
        driver._start_scheduler()
        jobs = driver.scheduler.get_jobs()
        assert {j.id for j in jobs} == {
            "seed",
            "lease-sweep",
            "staleness-expiry",
            "dead-worker-sweep",
            "supervise",
            "payload-retention",
            "user-errors",
        }
        for j in jobs:
            assert (j.coalesce, j.misfire_grace_time, j.max_instances) == (True, 60, 1), j.id
        assert MISFIRE_GRACE_S >= 60  # generous against intervals of seconds
    finally:
        driver.close()
