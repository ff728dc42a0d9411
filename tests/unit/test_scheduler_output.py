"""The control plane's scheduler keeps the terminal quiet: APScheduler's "Run time of job ... was
missed by ..." warnings go to the run directory's ``driver.log``, never to the console, and are
counted (``rollcall_scheduler_missed_runs_total``); a run a few seconds late still runs.

The driver runs in a child process, started as ``rollcall run`` is (no logging set up by a test
harness), so that what reaches its stderr is what a user would see."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys, threading
from datetime import datetime, timedelta, timezone
from pathlib import Path

from apscheduler.events import EVENT_JOB_EXECUTED, EVENT_JOB_MISSED

from rollcall.orchestrator.config import RollcallConfig
from rollcall.orchestrator.runner.driver import JobDriver
from rollcall.orchestrator.runner.rundir import RunDir


class ControlPlane:  # the control plane's calls, doing nothing
    def seed(self): return {}
    def sweep_expired_leases(self): return None
    def expire_stale(self): return {}
    def sweep_dead_workers(self, *args): return []
    def drop_old_payloads(self): return 0, 0
    def drop_old_events(self, *args): return 0


root = Path(sys.argv[1])
driver = JobDriver(
    RollcallConfig.model_validate({"job": {"name": "quiet"}}), None,
    model_dir=root, home=root, live=False,
)
driver.control_buffer = ControlPlane()
driver.run_dir = RunDir(root / "run")
driver._start_scheduler()
s = driver.scheduler
done = {"missed": threading.Event(), "ran": threading.Event()}
s.add_listener(lambda e: done["missed"].set(), EVENT_JOB_MISSED)
s.add_listener(lambda e: e.job_id == "late" and done["ran"].set(), EVENT_JOB_EXECUTED)
now = datetime.now(timezone.utc)
# ten minutes late: the process was frozen; a few seconds late: a loaded machine
s.add_job(print, "interval", seconds=3600, id="frozen", next_run_time=now - timedelta(minutes=10))
s.add_job(print, "interval", seconds=3600, id="late", next_run_time=now - timedelta(seconds=5))
assert done["missed"].wait(60) and done["ran"].wait(60)
from rollcall.orchestrator.runner.metrics import MetricsExporter

exporter = MetricsExporter(None, 1, "quiet", missed_runs=driver.missed_runs)
samples = {
    s.labels["scheduler_job"]: s.value
    for fam in exporter.collect() if fam.name == "rollcall_scheduler_missed_runs"
    for s in fam.samples
}
counts = driver.missed_runs.counts()
driver.close()
print(json.dumps({"counts": counts, "samples": samples}))
"""


@pytest.mark.timeout(180)
def test_missed_runs_are_logged_to_the_run_dir_and_counted_not_printed(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert "was missed by" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "run" / "driver.log").read_text()
    assert 'Run time of job "print (trigger: interval[1:00:00], next run at:' in log
    assert "was missed by 0:10:" in log
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # every control-plane job has a series (at 0), the frozen run is counted, the late one ran
    assert result["counts"] == {
        "seed": 0,
        "lease-sweep": 0,
        "staleness-expiry": 0,
        "dead-worker-sweep": 0,
        "supervise": 0,
        "payload-retention": 0,
        "user-errors": 0,
        "frozen": 1,
        "late": 0,
    }
    assert result["samples"]["frozen"] == 1.0 and result["samples"]["seed"] == 0.0
