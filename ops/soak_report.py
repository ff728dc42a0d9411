"""The soak's report (``ops/soak.py``): faults by kind with detection and recovery
percentiles, what was lost, the downs no fault explains, and the processes' slopes."""

from __future__ import annotations

import re
import time
from collections import Counter
from typing import Any

from ops.chaos import percentile
from rollcall.orchestrator.services.drills import DrillReport

# a down this long after a fault's recovery is still the fault's (a second death of a slot
# restarted into the fault's aftermath, a verdict Ray gave late)
DOWN_SLACK_S = 30.0
# faults at the whole job: any slot may go down in their window
JOB_WIDE = ("kill-driver", "crash-db")


def report_lines(t: dict[str, Any]) -> list[str]:
    """The report for a terminal: faults by kind with detection and recovery p50/p95/max,
    what was lost, the end's checks, failed starts, and the processes' slopes."""

    def fig(v: Any) -> str:
        return "-" if v is None else f"{v:.1f}"

    lines = [
        f"{t['faults']} faults in {t['wall_s'] / 3600:.2f} h, {t['steps']} steps; lost "
        f"{t['lost']}, duplicated {t['duplicated']} (at the end {t['duplicated_at_end']}); "
        f"invariants: {t['final_invariants']}; drivers {t['drivers']}, the last ended "
        f"{'cleanly' if t['driver_ended'] and t['driver_rc'] == 0 else 'NOT cleanly'}; "
        f"orphans at the end: {len(t['orphans_at_end'])}",
        f"{'kind':<28}{'n':>5}{'failed':>7}  detection p50/p95/max s   recovery p50/p95/max s",
    ]
    for kind, k in sorted(t["by_kind"].items()):
        det = "/".join(fig(k[f"detection_{q}_s"]) for q in ("p50", "p95", "max"))
        rec = "/".join(fig(k[f"recovery_{q}_s"]) for q in ("p50", "p95", "max"))
        lines.append(f"{kind:<28}{k['n']:>5}{k['failed']:>7}  {det:<24} {rec}")
    lines += [f"FAILED {f}" for f in t["failed"]]
    lines += [f"driver ended on its own: {e}" for e in t["driver_exits"]]
    lines += [f"failed start: {f['message']}" for f in t["failed_starts"]]
    lines.append(
        f"nodes and ranks down {t['downs']} times, {len(t['unprovoked'])} that no fault "
        "explains (outside its slot's faults, from a fault to its recovery)"
        + "".join(f"\n  {u}" for u in t["unprovoked"])
    )
    shown = (".pss_mb", ".threads", ".open_files", ".mb", ".database_mb", ".wal_mb", ".orphans",
             ".ray_workers")  # fmt: skip
    growth = {k: v for k, v in t["slopes"].items() if k.endswith(shown)}
    lines.append("slopes per hour (after the warm-up): " + "; ".join(
        f"{k} {v['per_hour']:+.2f}" + (f" ({v['pct_per_hour']:+.1f}%)"
                                        if v["pct_per_hour"] is not None else "")
        for k, v in sorted(growth.items())))  # fmt: skip
    return lines


def unprovoked(
    downs: list[tuple[float, str, str]], reports: list[DrillReport], timeout_s: float
) -> list[str]:
    """The downs (a node or rank restarted, its machine lost, or failed for good: ``(epoch
    seconds, slot, reason)``) that no fault explains: outside the window, from the fault to its
    recovery (``timeout_s`` where it did not recover) and ``DOWN_SLACK_S`` more, of every fault
    at that slot (its target names it) or at the whole job (the driver, the database). A false
    verdict (a busy node declared hung) or a defect. Each as ``HH:MM:SS slot: reason``."""

    def explains(r: DrillReport, at: float, slot: str) -> bool:
        end = r.fault_at + (timeout_s if r.recovery_s is None else r.recovery_s) + DOWN_SLACK_S
        at_slot = r.drill in JOB_WIDE or re.search(rf"\b{re.escape(slot)}\b", r.target)
        return bool(at_slot) and r.fault_at <= at <= end

    return [
        f"{time.strftime('%H:%M:%S', time.gmtime(at))} {slot}: {reason}"
        for at, slot, reason in downs
        if not any(explains(r, at, slot) for r in reports)
    ]


def totals_of(reports: list[DrillReport]) -> dict[str, Any]:
    kinds = sorted({r.drill for r in reports})
    per_kind: dict[str, Any] = {}
    for kind in kinds:
        chosen = [r for r in reports if r.drill == kind]
        row: dict[str, Any] = {"n": len(chosen), "failed": sum(not r.passed for r in chosen)}
        for name in ("detection", "recovery"):
            vals = [v for r in chosen if (v := getattr(r, f"{name}_s")) is not None]
            for q, label in ((0.5, "p50"), (0.95, "p95"), (1.0, "max")):
                v = percentile(vals, q)
                row[f"{name}_{label}_s"] = None if v is None else round(v, 2)
        per_kind[kind] = row
    return {
        "faults": len(reports),
        "by_kind": per_kind,
        "lost": sum(r.lost for r in reports),
        "duplicated": sum(r.duplicated for r in reports),
        "failed": [
            f"{r.drill} {r.target}: " + "; ".join(n for n in (r.invariant_summary, *r.notes) if n)
            for r in reports
            if not r.passed
        ],
        "kinds": dict(Counter(r.drill for r in reports)),
    }
