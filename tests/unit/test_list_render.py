"""``job list``, ``task list`` and the drill report stay readable in an 80-column terminal:
no line is wider than 80 columns and each row is one line (a job's name and status, a task's
name and quota, a drill's kind and figures share a line)."""

from __future__ import annotations

from rollcall.orchestrator.cli.drill import drill_table
from rollcall.orchestrator.cli.job import jobs_table
from rollcall.orchestrator.cli.task import tasks_table
from rollcall.orchestrator.services.drills import DrillReport
from tests.unit.test_status_render import check_width, line_with, render


def test_job_list_fits_80_columns() -> None:
    jobs = [
        {
            "name": name,
            "status": status,
            "policy_version": version,
            "tasks": n,
            "created_at": "2026-12-03T08:52:16.123456+00:00",
        }
        for name, status, version, n in [
            ("quickstart", "finished", 80, 2),
            ("calculator-lr3e-4-long-running-experiment", "running", 12345, 3),
            ("qs", "stopped", 7, 1),
        ]
    ]
    lines = render(jobs_table(jobs))
    check_width(lines)
    line_with(lines, "quickstart", "finished", "80", "2026-12-03 08:52:16")
    line_with(lines, "calculator-lr3e-4", "running", "12345", "2026-12-03 08:52:16")


def test_task_list_fits_80_columns() -> None:
    tasks = [
        {
            "name": name,
            "plugin": plugin,
            "status": status,
            "weight": weight,
            "max_inflight": inflight,
            "max_staleness": staleness,
            "partition": f"trajectories_t{i}",
        }
        for i, (name, plugin, status, weight, inflight, staleness) in enumerate(
            [
                ("calculator", "calculator", "active", 2.0, 12, 4),
                ("retrieval-multi-hop-hard", "retrieval", "quarantined", 0.5, 128, 16),
                ("guess", "guess", "retired", 1.0, 8, 8),
            ],
            start=101,
        )
    ]
    lines = render(tasks_table(tasks))
    check_width(lines)
    line_with(lines, "calculator", "active", "2", "12", "4", "trajectories_t101")
    line_with(lines, "retrieval-multi", "quarantined", "0.5", "128", "16")


def test_drill_report_fits_80_columns() -> None:
    reports = [
        DrillReport(
            drill="kill-rollout",
            job="quickstart",
            target="rollout-0 (pid 41234)",
            fault_at=0.0,
            detection_s=3.21,
            recovery_s=12.5,
            in_flight_episodes=16,
            in_flight_samples=128,
            resumed_turns=37,
        ),
        DrillReport(
            drill="restart-db",
            job="quickstart",
            target="embedded PostgreSQL",
            fault_at=0.0,
            detection_s=None,
            recovery_s=None,
            in_flight_episodes=4,
            in_flight_samples=32,
            invariants_ok=False,
            invariant_summary="2 trajectories consumed twice",
        ),
    ]
    lines = render(drill_table(reports))
    check_width(lines)
    line_with(lines, "kill-rollout", "rollout-0", "3.21", "12.50", "16", "128", "37", "ok")
    line_with(lines, "restart-db", "timed out", "32")
