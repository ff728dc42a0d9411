"""The pipeline benchmark's cost accounting: CPU of the embedded PostgreSQL, snapshots of the
nodes' and the driver's buffer timings at every step (``Monitor``), and the control plane's
share of a measured window (``window_costs``, ``control_plane``). Used by ``pipeline.py``."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollcall.orchestrator import procfs
from rollcall.orchestrator.buffer import timings

if TYPE_CHECKING:
    from ops.bench.pipeline import Setup


def postgres_cpu_s(pgdata: Path) -> tuple[float, int]:
    """CPU seconds of our PostgreSQL (the postmaster, its live children and reaped ones) and
    its number of child processes (client backends plus a few auxiliary ones)."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        pm = int((pgdata / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0, 0
    total, children = 0.0, 0
    for proc in procfs.processes():
        pid, ppid, fields = proc.pid, proc.ppid, proc.fields
        if pid == pm:
            total += sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
        elif ppid == pm:
            total += (int(fields[11]) + int(fields[12])) / tick
            children += 1
    return total, children


def wal_position(db: Any) -> int:
    """The database's current write-ahead log position, in bytes."""
    import sqlalchemy as sa

    with db.engine.connect() as conn:
        lsn = conn.execute(sa.text("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")).scalar_one()
    return int(lsn)


def machine_jiffies() -> tuple[int, int]:
    """All cores' busy and total jiffies since boot (``/proc/stat``; idle and iowait are idle)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(fields[:8])
    return total - fields[3] - fields[4], total


@dataclass
class Snap:
    at: float
    step: int
    nodes: list[dict[str, Any]]
    driver_ops: dict[str, Any]
    pg_cpu_s: float
    pg_processes: int
    driver_cpu_s: float
    wal_bytes: int  # pg_current_wal_lsn() as a byte position
    machine: tuple[int, int]  # /proc/stat: busy and total jiffies of all cores


class Monitor(threading.Thread):
    """Snapshots of the costs (nodes' and driver's buffer timings, CPU) at every step. The
    driver's timings are those taken the moment each step committed (``committed``), so a
    window of steps counts exactly its own claims and commits however fast the steps go; the
    rest is read when this thread sees the step change (every 50 ms)."""

    def __init__(self, driver: Any, pgdata: Path) -> None:
        super().__init__(name="bench-monitor", daemon=True)
        self.driver, self.pgdata = driver, pgdata
        self.snaps: dict[int, Snap] = {}
        self.done = threading.Event()
        self.driver_ops_at: dict[int, dict[str, Any]] = {}  # version -> at its commit

    def committed(self, version: int) -> None:
        self.driver_ops_at[version] = self.driver.control_buffer.timings.snapshot()

    def snap(self) -> Snap | None:
        import ray

        sup = self.driver.supervisor
        if sup is None:
            return None
        step = int(self.driver.step)
        try:
            reports = ray.get([a.report.remote() for a in sup.book.actors], timeout=10)
        except Exception:
            return None
        if not reports:  # the nodes are stopping (the job's end) or restarting
            return None
        pg_cpu, pg_procs = postgres_cpu_s(self.pgdata)
        try:
            wal = wal_position(self.driver.db)
        except Exception:  # the database is busy or going away: no snapshot this time
            return None
        driver_ops = self.driver_ops_at.get(step) or self.driver.control_buffer.timings.snapshot()
        return Snap(
            time.monotonic(), step, reports, driver_ops, pg_cpu, pg_procs, time.process_time(),
            wal, machine_jiffies(),
        )  # fmt: skip

    def run(self) -> None:
        last = -1
        while not self.done.wait(0.05):
            step = int(self.driver.step)
            if step != last:
                s = self.snap()
                if s is not None:
                    self.snaps.setdefault(s.step, s)
                    last = step

    def final(self) -> None:
        """The last step's snapshot, taken before the driver stops the nodes (the thread's own
        may race with the teardown)."""
        s = self.snap()
        if s is not None:
            self.snaps[s.step] = s


def window_costs(a: Snap, b: Snap) -> dict[str, Any]:
    """Control-plane costs between two snapshots, summed over the rollout nodes (nodes that
    restarted in between are left out) and the driver."""
    before = {r["worker_id"]: r for r in a.nodes}
    node_ops, node_cpu, committed, batches, batched = [], 0.0, 0, 0, 0
    for r in b.nodes:
        old = before.get(r["worker_id"])
        if old is None:
            continue
        node_ops.append(timings.diff(r["buffer_ops"], old["buffer_ops"]))
        node_cpu += r["process_cpu_s"] - old["process_cpu_s"]
        committed += r["samples_committed"] - old["samples_committed"]
        batches += r.get("write_batches", 0) - old.get("write_batches", 0)
        batched += r.get("writes_batched", 0) - old.get("writes_batched", 0)
    rollout = timings.merge(node_ops)
    driver = timings.diff(b.driver_ops, a.driver_ops)
    return {
        "rollout_ops": rollout,
        "driver_ops": driver,
        "node_cpu_s": node_cpu,
        "pg_cpu_s": b.pg_cpu_s - a.pg_cpu_s,
        "driver_cpu_s": b.driver_cpu_s - a.driver_cpu_s,
        "wal_bytes": b.wal_bytes - a.wal_bytes,
        # the whole machine's busy share (all processes: nodes, tools, Ray, PostgreSQL, driver)
        "machine_busy": (b.machine[0] - a.machine[0]) / max(1, b.machine[1] - a.machine[1]),
        "samples_committed": committed,
        # the nodes' group commits: transactions of checkpoints and commits, and their writes
        "write_batches": batches,
        "writes_batched": batched,
    }


def control_plane(setup: Setup, costs: dict[str, Any], span_s: float, steps: int) -> dict[str, Any]:
    trajectories = max(1, steps * setup.batch_groups * setup.group_size)
    loops = setup.nodes * setup.concurrency
    node, driver = costs["rollout_ops"], costs["driver_ops"]
    node_wall = sum(v["wall_s"] for v in node.values())
    node_cpu = sum(v["cpu_s"] for v in node.values())
    driver_wall = sum(v["wall_s"] for v in driver.values())
    driver_cpu = sum(v["cpu_s"] for v in driver.values())
    claim = node.get("claim", {"hist": [0], "calls": 0, "wall_s": 0.0})

    def per_traj_ms(seconds: float) -> float:
        return seconds / trajectories * 1000

    ops = {**_prefix(node, "node."), **_prefix(driver, "driver.")}
    return {
        "window_s": span_s,
        "trajectories": trajectories,
        "rollout_wall_ms_per_traj": per_traj_ms(node_wall),
        "rollout_cpu_ms_per_traj": per_traj_ms(node_cpu),
        "driver_wall_ms_per_traj": per_traj_ms(driver_wall),
        "driver_cpu_ms_per_traj": per_traj_ms(driver_cpu),
        "pg_cpu_ms_per_traj": per_traj_ms(costs["pg_cpu_s"]),
        "node_process_cpu_ms_per_traj": per_traj_ms(costs["node_cpu_s"]),
        "driver_process_cpu_ms_per_traj": per_traj_ms(costs["driver_cpu_s"]),
        # the control plane's CPU: the database server and the clients' own work in its calls
        "cpu_ms_per_traj": per_traj_ms(node_cpu + driver_cpu + costs["pg_cpu_s"]),
        # shares of the wall time: the agent loops' time in buffer calls, and the driver's
        "rollout_share": node_wall / (loops * span_s),
        "driver_share": driver_wall / span_s,
        # the part of it the trainer waits for: the step's batch claim and commit (the rest runs
        # on the driver's scheduler and after-step threads while the trainer trains)
        "trainer_path_share": sum(
            driver.get(k, {}).get("wall_s", 0.0) for k in ("claim_batch", "commit_step")
        )
        / span_s,
        # the same at a time scale of 1 (a real deployment: the modelled work takes 1/scale
        # longer, the database calls as long as here)
        "rollout_share_at_scale_1": node_wall / (loops * span_s / setup.scale),
        "driver_share_at_scale_1": driver_wall / (span_s / setup.scale),
        # the write-ahead log: every write the database makes (what a replica or a backup
        # receives), per trajectory and per real second of the window
        "wal_kb_per_traj": costs["wal_bytes"] / trajectories / 1000,
        "wal_mb_per_s": costs["wal_bytes"] / span_s / 1e6,
        "machine_busy": costs["machine_busy"],
        "writes_per_transaction": (
            costs["writes_batched"] / costs["write_batches"] if costs["write_batches"] else None
        ),
        "claim_calls": claim["calls"],
        "claim_p50_ms": _ms(timings.percentile_s(claim["hist"], 50)),
        "claim_p99_ms": _ms(timings.percentile_s(claim["hist"], 99)),
        "claim_mean_ms": claim["wall_s"] / claim["calls"] * 1000 if claim["calls"] else None,
        "ops": {
            k: {"calls": v["calls"], "wall_s": round(v["wall_s"], 3), "cpu_s": round(v["cpu_s"], 3)}
            for k, v in sorted(ops.items())
        },
    }


def _prefix(ops: dict[str, Any], p: str) -> dict[str, Any]:
    return {p + k: v for k, v in ops.items()}


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 3)
