"""The soak's resource sampling (``ops/soak.py``): once a minute, what every process of the job
holds, what PostgreSQL and the run directory hold, and which processes are orphans; written
to a CSV (long form: ``elapsed_s,series,metric,value``), plotted against time and reduced to a
slope per hour.

Processes: the driver, each live rollout node and trainer rank and the evaluator (by slot
name, so a slot's incarnations make one series), PostgreSQL (its postmaster and backends
together). Memory is PSS (``/proc/PID/smaps_rollup``), which splits shared pages between their
users, so PostgreSQL's shared buffers are not counted once per backend.
Orphans: vLLM EngineCores and forkserver/tool processes that no live rollout node owns, and
Ray workers (``ray::``) whose parent is gone (re-parented to init).
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from rollcall.orchestrator import procfs
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.engineprocs import ENGINE_CORE

MB = 1 << 20


def process_figures(pid: int) -> dict[str, float] | None:
    """PSS (MB), threads and open files of a process, None when it is gone."""
    base = Path(f"/proc/{pid}")
    try:
        pss = 0
        for line in (base / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
        threads = 0
        for line in (base / "status").read_text().splitlines():
            if line.startswith("Threads:"):
                threads = int(line.split()[1])
        files = sum(1 for _ in (base / "fd").iterdir())
    except (OSError, ValueError):
        return None
    return {"pss_mb": pss / MB, "threads": threads, "open_files": files}


def tree_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += (Path(root) / f).lstat().st_size
    return total


def _of_home(pid: int, home: Path | None) -> bool:
    """Whether the process runs for the job in ``home`` (its environment names it, inherited
    from ``ray start`` and the driver); any process when ``home`` is None."""
    if home is None:
        return True
    try:
        return f"ROLLCALL_HOME={home}\0".encode() in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def orphans(owners: set[int], home: Path | None = None) -> list[str]:
    """EngineCores and forkserver processes not under any of ``owners`` (live rollout nodes'
    pids), and Ray worker processes whose parent is init: ``pid name`` each; with ``home``,
    only the processes of the job in that home."""
    found = []
    for s in procfs.processes():
        if s.zombie or not _of_home(s.pid, home):
            continue
        line = procfs.cmdline(s.pid)
        engine = s.name == ENGINE_CORE
        forked = procfs.is_forked(line) and "ray::" not in line
        if engine or forked:
            if not _under(s.pid, owners):
                found.append(f"{s.pid} {'EngineCore' if engine else 'forkserver/tool'}")
        elif line.startswith("ray::") and s.ppid == 1:
            found.append(f"{s.pid} {line[:40]}")
    return found


def _under(pid: int, owners: set[int]) -> bool:
    p: int | None = pid
    for _ in range(64):
        p = procfs.parent_of(p) if p else None
        if not p or p == 1:
            return False
        if p in owners:
            return True
    return False


def _postgres_pids(home: Path) -> list[int]:
    try:
        postmaster = int((home / "postgres" / "data" / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return []
    return [postmaster, *procfs.children_of(postmaster)]


class Sampler:
    """Samples every ``every_s`` into ``home/resources.csv`` from a thread of its own."""

    def __init__(
        self,
        db: Database,
        job_id: int,
        home: Path,
        driver: Callable[[], Any],
        every_s: float = 60.0,
    ) -> None:
        self.db, self.job_id, self.home, self.driver = db, job_id, home, driver
        self.every_s = every_s
        self.path = home / "resources.csv"
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-sampler", daemon=True)

    def start(self) -> None:
        with self.path.open("w", newline="") as f:
            csv.writer(f).writerow(["elapsed_s", "series", "metric", "value"])
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def _loop(self) -> None:
        while True:
            try:
                rows = self.sample()
            except Exception as e:  # a sample missed (the database restarting): said, not fatal
                rows = [("sampler", "error", 1.0)]
                print(f"     (resource sample missed: {type(e).__name__}: {e})", flush=True)
            t = round(time.monotonic() - self.t0, 1)
            with self.path.open("a", newline="") as f:
                csv.writer(f).writerows([(t, *row) for row in rows])
            if self._stop.wait(self.every_s):
                return

    def sample(self) -> list[tuple[str, str, float]]:
        rows: list[tuple[str, str, float]] = []
        procs: dict[str, list[int]] = {}
        driver = self.driver()
        if driver is not None and driver.poll() is None:
            procs["driver"] = [driver.pid]
        with self.db.transaction() as tx:
            workers = [w for w in tx.workers.health(self.job_id) if w["status"] == "alive"]
            q = tx.session.execute
            db_bytes = q(sa.text("SELECT pg_database_size(current_database())")).scalar_one()
            tables = q(sa.text(
                "SELECT relname, pg_total_relation_size(relid), n_dead_tup "
                "FROM pg_stat_user_tables ORDER BY 2 DESC LIMIT 8")).all()  # fmt: skip
            try:
                with tx.session.begin_nested():
                    wal = q(sa.text("SELECT coalesce(sum(size), 0) FROM pg_ls_waldir()"))
                    wal_bytes = float(wal.scalar_one())
            except Exception:
                wal_bytes = math.nan  # the role may not read the WAL directory
            events = q(sa.text("SELECT count(*) FROM events WHERE job_id = :j"),
                       {"j": self.job_id}).scalar_one()  # fmt: skip
        for w in workers:
            if w.get("pid") and w.get("host") == os.uname().nodename:
                procs[str(w["name"])] = [int(w["pid"])]
        procs["postgres"] = _postgres_pids(self.home)
        evaluator = [s.pid for s in procfs.processes()
                     if procfs.cmdline(s.pid).startswith("ray::Evaluator")
                     and _of_home(s.pid, self.home)]  # fmt: skip
        if evaluator:
            procs["evaluator"] = evaluator
        for name, pids in procs.items():
            figures = [f for p in pids if (f := process_figures(p)) is not None]
            for metric in ("pss_mb", "threads", "open_files"):
                if figures:
                    rows.append((name, metric, round(sum(f[metric] for f in figures), 2)))
        rows.append(("postgres", "database_mb", db_bytes / MB))
        rows.append(("postgres", "wal_mb", wal_bytes / MB))
        rows.append(("postgres", "event_rows", float(events)))
        for relname, size, dead in tables:
            rows.append((f"table:{relname}", "total_mb", size / MB))
            rows.append((f"table:{relname}", "dead_rows", float(dead)))
        rows.append(("run_dir", "mb", tree_size(self.home / "run") / MB))
        rows.append(("home", "mb", tree_size(self.home) / MB))
        ray_workers = sum(procfs.cmdline(s.pid).startswith("ray::") for s in procfs.processes())
        engines = sum(s.name == ENGINE_CORE for s in procfs.processes())
        rows.append(("processes", "ray_workers", float(ray_workers)))
        rows.append(("processes", "engine_cores", float(engines)))
        # what owns engines and tool processes: the nodes, the evaluator (its own tools), the
        # driver
        owners = {p for pids in procs.values() for p in pids} | {
            int(w["pid"]) for w in workers if w.get("pid")
        }
        owners |= {s.pid for s in procfs.processes() if procfs.cmdline(s.pid).startswith(
            ("ray::Evaluator", "ray::RolloutNode"))}  # fmt: skip
        rows.append(("processes", "orphans", float(len(orphans(owners, self.home)))))
        return rows


def read(path: Path) -> dict[tuple[str, str], list[tuple[float, float]]]:
    series: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    with path.open() as f:
        for row in csv.DictReader(f):
            value = float(row["value"])
            if not math.isnan(value):
                series[(row["series"], row["metric"])].append((float(row["elapsed_s"]), value))
    return series


def slope(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares slope per hour, and that as a percentage of the mean per hour."""
    if len(points) < 3:
        return None
    xs = [t / 3600 for t, _ in points]
    ys = [v for _, v in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return b, (100 * b / my if my else math.nan)


def slopes(path: Path, skip_s: float | None = None) -> dict[str, Any]:
    """Each series' slope per hour, from samples after the first hour (or, in a run shorter
    than two hours, after its first quarter): the warm-up (models loading, caches filling)
    is not growth."""
    series = read(path)
    end = max((p[-1][0] for p in series.values() if p), default=0.0)
    skip = skip_s if skip_s is not None else (3600.0 if end >= 7200 else end / 4)
    out: dict[str, Any] = {}
    for (name, metric), points in sorted(series.items()):
        s = slope([p for p in points if p[0] >= skip])
        if s is not None:
            out[f"{name}.{metric}"] = {
                "per_hour": round(s[0], 3),
                "pct_per_hour": None if math.isnan(s[1]) else round(s[1], 2),
                "last": points[-1][1],
            }
    return out


def plot(path: Path, out: Path, title: str) -> Path | None:
    """Resources against time, four panels (matplotlib's Agg, as the learning curve)."""
    series = read(path)
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("memory (PSS, MB)", lambda n, m: m == "pss_mb"),
        ("threads and open files", lambda n, m: m in ("threads", "open_files")),
        ("disk and database (MB)", lambda n, m: m in ("mb", "database_mb", "wal_mb")),
        ("processes", lambda n, m: n == "processes"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), dpi=100)
    for ax, (label, pick) in zip(axes.flat, panels, strict=True):
        for (name, metric), points in sorted(series.items()):
            if pick(name, metric):
                ax.plot([t / 3600 for t, _ in points], [v for _, v in points],
                        label=f"{name} {metric}", linewidth=1)  # fmt: skip
        ax.set_title(label)
        ax.set_xlabel("hours")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
