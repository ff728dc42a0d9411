"""A randomized chaos run against a running job: many faults, one after another, each waited
out, then the totals: faults injected, detection and recovery times (p50/p99), and what was
lost or trained twice (both must be 0).

Faults (weights): a rollout node SIGKILLed (4), a rollout node SIGSTOPped (3), the trainer's
rank 0 SIGKILLed (2), the embedded PostgreSQL restarted (1, only with ``--restart-db``) or
kept down longer than the heartbeat timeout (1, ``--outage-s``), and a CPU-overload phase
(1, ``--overload-s``: busy-loop processes, three per core, for that long; nothing else is
injected meanwhile and nobody may be declared dead for it).

Besides lost and duplicated work, the totals count false deaths: workers that ended dead or
failed beyond the ones a fault was aimed at (an overload or an outage aims at nobody), and
the restarts the supervisor counted against the slots' budgets.

Usage (next to a job started with `rollcall run`, on the same machine):
    python ops/chaos.py --job NAME [--faults 200] [--seed 0] [--restart-db] [--outage-s 12]
                        [--overload-s 60]
Prints a table, then (last line) one JSON object with the totals.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollcall.orchestrator.services.drills import DrillReport, Drills

KINDS = {
    "kill-rollout": 4,
    "hang-rollout": 3,
    "kill-trainer": 2,
    "restart-db": 1,
    "db-outage": 1,
    "overload": 1,
}
# the workers a fault is aimed at (each ends one incarnation); the others aim at nobody
AIMED = {"kill-rollout": 1, "hang-rollout": 1, "kill-trainer": 1}


def _ended_workers(drills: Drills, since: float) -> int:
    """Worker incarnations of the job that ended dead or failed after ``since`` (epoch s)."""
    with drills.db.transaction() as tx:
        return tx.invariants.workers_ended_since(drills.job.id, since)


def _counted_restarts(drills: Drills, since: float) -> int:
    with drills.db.transaction() as tx:
        return tx.invariants.events_since(drills.job.id, "worker.restarting", since)


class BusyLoops:
    """``n`` busy-loop processes (``while True: pass``, default three per core) from creation
    until ``end`` (or the ``with`` block's end): a CPU overload beside a job."""

    def __init__(self, n: int | None = None) -> None:
        self.n = 3 * (os.cpu_count() or 1) if n is None else n
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            for _ in range(self.n):
                self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        except BaseException:  # one failed to start: end the ones that did
            self.end()
            raise

    def end(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()

    def __enter__(self) -> BusyLoops:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


def overload(drills: Drills, seconds: float) -> DrillReport:
    """Busy loops, three per core, for ``seconds``; a pass when nobody was declared dead."""
    r = DrillReport("overload", drills.job.name, "", time.time())
    before = _ended_workers(drills, r.fault_at)
    with BusyLoops() as loops:
        r.target = f"{loops.n} busy loops"
        time.sleep(seconds)
    r.detection_s = 0.0
    r.recovery_s = seconds
    dead = _ended_workers(drills, r.fault_at) - before
    if dead:
        r.invariants_ok = False
        r.invariant_summary = f"{dead} workers declared dead during the overload"
    return r


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def run_chaos(
    drills: Drills,
    faults: int,
    *,
    seed: int = 0,
    restart_db: Callable[[], None] | None = None,
    outage: Callable[[], None] | None = None,
    overload_s: float = 0.0,
    pause_s: float = 0.5,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Inject ``faults`` faults one by one (each waited out); return the totals."""
    rng = random.Random(seed)
    available = {
        "restart-db": restart_db is not None,
        "db-outage": outage is not None,
        "overload": overload_s > 0,
    }
    kinds = {k: w for k, w in KINDS.items() if available.get(k, True)}
    wall0 = time.time()
    reports: list[DrillReport] = []
    done: list[str] = []
    failed_lines: list[str] = []  # each failed fault's line and notes
    t0 = time.monotonic()
    for i in range(faults):
        kind = rng.choices(list(kinds), weights=list(kinds.values()))[0]
        if kind == "kill-rollout":
            r = drills.kill_rollout(1, "KILL")[0]
        elif kind == "hang-rollout":
            r = drills.kill_rollout(1, "STOP")[0]
        elif kind == "kill-trainer":
            r = drills.kill_trainer()
        elif kind == "overload":
            r = overload(drills, overload_s)
        elif kind == "db-outage":
            assert outage is not None
            r = drills.restart_db(outage)
            r.drill = "db-outage"
        else:
            assert restart_db is not None
            r = drills.restart_db(restart_db)
        reports.append(r)
        done.append(kind)
        lines = [
            f"{i + 1:>4} {r.drill:<24} {r.target:<10} detect {r.detection_s or 0:6.2f} s  "
            f"recover {r.recovery_s if r.recovery_s is not None else float('nan'):6.2f} s  "
            f"lost {r.lost} dup {r.duplicated} {'ok' if r.passed else 'FAILED'}"
        ]
        if not r.passed:
            lines += [f"     {note}" for note in (r.invariant_summary, *r.notes) if note]
            failed_lines += lines
        for line in lines:
            say(line)
        time.sleep(pause_s)
    totals: dict[str, Any] = {
        "faults": len(reports),
        "wall_s": round(time.monotonic() - t0, 1),
        "by_kind": dict(Counter(done)),
        "lost": sum(r.lost for r in reports),
        "duplicated": sum(r.duplicated for r in reports),
        "failed": sum(not r.passed for r in reports),
        "false_deaths": max(0, _ended_workers(drills, wall0) - sum(AIMED.get(k, 0) for k in done)),
        "restarts_counted": _counted_restarts(drills, wall0),
        "in_flight_samples": sum(r.in_flight_samples for r in reports),
        "resumed_turns": sum(r.resumed_turns for r in reports),
        "failed_faults": failed_lines,
    }
    for label, pick in (
        ("rollout_kill", lambda r: r.drill == "kill-rollout --signal KILL"),
        ("rollout_hang", lambda r: r.drill == "kill-rollout --signal STOP"),
        ("trainer", lambda r: r.drill == "kill-trainer"),
        ("db_outage", lambda r: r.drill == "db-outage"),
    ):
        chosen = [r for r in reports if pick(r)]
        det = [r.detection_s for r in chosen if r.detection_s is not None]
        rec = [r.recovery_s for r in chosen if r.recovery_s is not None]
        for name, vals in (("detection", det), ("recovery", rec)):
            for q in (0.5, 0.99):
                v = percentile(vals, q)
                totals[f"{label}_{name}_p{int(q * 100)}_s"] = None if v is None else round(v, 3)
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--job", required=True)
    ap.add_argument("--faults", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--restart-db", action="store_true")
    ap.add_argument(
        "--outage-s", type=float, default=0.0, help="also keep the database down this long"
    )
    ap.add_argument("--overload-s", type=float, default=0.0, help="also CPU-overload phases")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--database-url", default=None)
    args = ap.parse_args()

    from rollcall.orchestrator.db.embedded import EmbeddedPostgres
    from rollcall.orchestrator.db.engine import open_database

    db = open_database(args.database_url)
    restart = outage = None
    if args.restart_db or args.outage_s:
        if not db.target.embedded:
            sys.exit("--restart-db and --outage-s stop the embedded PostgreSQL only")
        server = EmbeddedPostgres(db.target.home)

        def restart() -> None:
            server.stop()
            server.ensure_running()

        def outage() -> None:
            server.stop()
            time.sleep(args.outage_s)
            server.ensure_running()

    try:
        totals = run_chaos(
            Drills(db, args.job, timeout_s=args.timeout),
            args.faults,
            seed=args.seed,
            restart_db=restart if args.restart_db else None,
            outage=outage if args.outage_s else None,
            overload_s=args.overload_s,
        )
    finally:
        db.dispose()
    print(json.dumps(totals))


if __name__ == "__main__":
    main()
