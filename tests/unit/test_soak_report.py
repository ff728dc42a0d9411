"""The soak's report (``ops/soak_report.py``): a node or rank that went down outside every
fault's window is named (a false verdict or a defect); one inside a window is the fault's."""

from __future__ import annotations

from ops.soak_report import DOWN_SLACK_S, report_lines, totals_of, unprovoked
from rollcall.orchestrator.services.drills import DrillReport

T0 = 1_796_620_000.0  # 2026-12-07 05:06:40 UTC


def _fault(at: float, recovery_s: float | None, target: str = "rollout-1") -> DrillReport:
    drill = "kill-driver" if target.startswith("driver") else "kill-rollout --signal KILL"
    r = DrillReport(drill, "soak", target, T0 + at)
    r.detection_s, r.recovery_s = 1.0, recovery_s
    return r


def test_downs_no_fault_explains_are_named() -> None:
    faults = [_fault(100, 25.0), _fault(400, None), _fault(900, 20.0, "driver pid 7")]
    downs = [
        (T0 + 101, "rollout-1", "actor died"),  # the first fault's
        (T0 + 125 + DOWN_SLACK_S - 1, "rollout-1", "actor died"),  # its aftermath
        (T0 + 110, "rollout-0", "no generation progress for 30.2 s"),  # not that fault's slot
        (T0 + 300, "rollout-0", "no generation progress for 30.2 s"),  # no fault near
        (T0 + 400 + 200, "rollout-1", "actor died"),  # within the second's timeout
        (T0 + 99, "trainer-0", "actor died"),  # just before a fault: not its doing
        (T0 + 905, "trainer-0", "actor died"),  # the driver's kill: any slot
        (T0 + 110, "rollout-10", "actor died"),  # rollout-1's fault is not rollout-10's
    ]
    assert unprovoked(downs, faults, timeout_s=300.0) == [
        "05:08:30 rollout-0: no generation progress for 30.2 s",
        "05:11:40 rollout-0: no generation progress for 30.2 s",
        "05:08:19 trainer-0: actor died",
        "05:08:30 rollout-10: actor died",
    ]
    assert len(unprovoked(downs, [], timeout_s=300.0)) == len(downs)


def test_the_report_says_how_many_downs_no_fault_explains() -> None:
    totals = totals_of([_fault(100, 25.0)])
    totals.update(
        wall_s=3600.0, steps=10, duplicated_at_end=0, final_invariants="all hold",
        drivers=1, driver_ended=True, driver_rc=0, orphans_at_end=[], driver_exits=[],
        failed_starts=[], slopes={}, downs=2,
        unprovoked=["05:11:40 rollout-0: no generation progress for 30.2 s"],
    )  # fmt: skip
    text = "\n".join(report_lines(totals))
    assert "down 2 times, 1 that no fault explains" in text
    assert "\n  05:11:40 rollout-0: no generation progress for 30.2 s" in text
