"""The invariant checker: the invariants of docs/architecture.md, checked against the database.

``check_invariants`` runs every check for a job and returns a report; ``report.ok`` is what
tests and drills assert. It reads only (one transaction), so it can run against a live job;
run it after the lease sweep when checking ``dead_leases`` on a job whose workers just died.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.db.repos.invariants import CHECKS


@dataclass(frozen=True)
class InvariantReport:
    violations: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(self.violations.values())

    def summary(self) -> str:
        if self.ok:
            return f"all {len(CHECKS)} invariants hold"
        bad = [
            f"{name} ({CHECKS[name][0]}): {rows[:3]}"
            for name, rows in self.violations.items()
            if rows
        ]
        return "violated: " + "; ".join(bad)


def check_invariants(db: Database, job_id: int, *, skip: tuple[str, ...] = ()) -> InvariantReport:
    with db.transaction() as tx:
        return InvariantReport(
            {name: tx.invariants.violations(job_id, name) for name in CHECKS if name not in skip}
        )
