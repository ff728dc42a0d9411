"""A long job's history against a fresh job's: what status, metrics, sweeps, claims and the
invariant checker cost once a job is weeks old (issue 59).

On one embedded PostgreSQL (a temporary ROLLCALL_HOME) it synthesizes two jobs straight into
the database, each in a database of its own:

- ``aged``: ``--days`` (14) at ``--steps-per-hour`` (540) and ``--samples-per-step`` (48, groups
  of ``--group-size`` 8, two tasks): 181,440 steps, 8.7 million trajectories, with metadata
  retention (``buffer.metadata_retention_steps``, ``rollcall_compact_steps``) applied as it
  would have been: the steps older than the last two hours exist as what retention leaves of
  them (a ``train_steps`` row each, and the totals in ``compacted_steps`` /
  ``compacted_episodes``), the last two hours as full rows, of which the function then
  compacts the older hour in passes of 50 steps, as the driver's retention pass does (the
  hour's guard keeps the last hour). Payload segments for the last 100 steps (payload
  retention's default), one expired group every 20 steps (its prompt trained by a newer
  episode), a quarantined one every 100 (kept: retention leaves them for inspection), and 16
  rollout slots restarted once a day.
- ``fresh``: the same job's first ``--fresh-hours`` (1) hour, all of it full rows.

Both have the same work in flight (per task: 64 queued episodes, 8 leased, 4 finished and
waiting for the trainer). Then it times, ``--repeats`` times each, alternating the two jobs:
a metrics collection (``MetricsExporter.refresh``: a scrape reads what it collected), the
document of ``rollcall status --json``, a sweep pass (expired leases, staleness expiry, dead
workers), a claim (``RolloutBuffer.claim``; the lease is released again, untimed), the
invariant checker, and ``rollcall db upgrade`` (the CLI in a process of its own, at head).

A ratio is the aged job's median over the fresh job's, each at least ``FLOOR_MS`` (3 ms):
an operation under 3 ms on both counts 1.0, and a 2 ms one that becomes 3 ms passes. Goal:
every ratio at most 1.5. Also reported: each database's size, the compaction passes' time,
and the bytes a further day adds (the per-step summaries: a ``train_steps`` row per step).

With ``--no-retention`` the aged job is every step's full rows, nothing compacted (what a job
of that age held before migration 0011): the same operations then cost what its age costs.

Usage: python ops/bench/history.py [--days 14] [--steps-per-hour 540] [--samples-per-step 48]
       [--group-size 8] [--fresh-hours 1] [--repeats 15] [--quick] [--no-retention] [--json]
``--quick``: 2 days and 5 repeats, for a smoke run. Prints a table, and with ``--json`` one
JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402

from rollcall.orchestrator.buffer.control import ControlPlaneBuffer  # noqa: E402
from rollcall.orchestrator.buffer.invariants import check_invariants  # noqa: E402
from rollcall.orchestrator.buffer.rollout import RolloutBuffer  # noqa: E402
from rollcall.orchestrator.config import BufferConfig  # noqa: E402
from rollcall.orchestrator.db import migrate  # noqa: E402
from rollcall.orchestrator.db.embedded import SUPERUSER, EmbeddedPostgres  # noqa: E402
from rollcall.orchestrator.db.engine import Database, open_database  # noqa: E402
from rollcall.orchestrator.runner.metrics import MetricsExporter  # noqa: E402
from rollcall.orchestrator.services.status import status_document  # noqa: E402

FLOOR_MS = 3.0
GOAL = 1.5
JOB = "history"
ROLLOUT_SLOTS = 16
FULL_HOURS = 2  # the newest hours synthesized as full rows (retention compacts the older one)
PAYLOAD_STEPS = 100  # payload retention's default: segments kept for the last 100 steps
METRIC_KEYS = 30  # numbers in a step's metrics (losses, rewards per task, timings, ...)


@dataclass(frozen=True)
class Shape:
    steps_per_hour: int
    samples_per_step: int
    group_size: int

    @property
    def groups(self) -> int:
        return self.samples_per_step // self.group_size


def _exec(conn: sa.Connection, sql: str, **params: Any) -> Any:
    return conn.execute(sa.text(sql), params)


def setup_job(conn: sa.Connection) -> tuple[int, list[int], list[int]]:
    """The job, its two tasks (their partitions) and its workers: 16 rollout slots restarted
    once a day (the latest incarnation alive) and a trainer. Returns (job, tasks, live
    rollout workers)."""
    job = _exec(
        conn,
        "INSERT INTO jobs (name, status, config) VALUES (:n, 'running', "
        """'{"run": {"mode": "async"}, "control_plane": {"heartbeat_timeout_s": 1e9}}') """
        "RETURNING id",
        n=JOB,
    ).scalar_one()
    tasks = []
    for name in ("math", "code"):
        t = _exec(
            conn,
            "INSERT INTO tasks (job_id, name, plugin, spec, weight, max_inflight, "
            "max_staleness) VALUES (:j, :n, 'echo', :spec, 1, 1000, 4) RETURNING id",
            j=job,
            n=name,
            spec=json.dumps({"group_size": 8}),
        ).scalar_one()
        _exec(conn, "SELECT rollcall_attach_task_partition(:t)", t=t)
        tasks.append(t)
    return job, tasks, []


def add_workers(conn: sa.Connection, job: int, days: float) -> list[int]:
    incarnations = max(1, int(days))
    _exec(
        conn,
        """
        INSERT INTO workers (job_id, role, name, incarnation, status, host, pid, restarts,
                             started_at, stopped_at, tokens_generated, loaded_version)
        SELECT :j, 'rollout', 'rollout-' || n, i,
               CASE WHEN i = :k - 1 THEN 'alive' ELSE 'dead' END::worker_status, 'h', 1000 + i, i,
               now() - make_interval(days => :k - i),
               CASE WHEN i = :k - 1 THEN NULL ELSE now() - make_interval(days => :k - i - 1) END,
               1000000, 1
        FROM generate_series(0, :slots - 1) n, generate_series(0, :k - 1) i
        """,
        j=job,
        k=incarnations,
        slots=ROLLOUT_SLOTS,
    )
    _exec(
        conn,
        "INSERT INTO workers (job_id, role, name, status) VALUES (:j, 'trainer', 'trainer-0', "
        "'alive')",
        j=job,
    )
    _exec(
        conn,
        "INSERT INTO events (job_id, kind, actor, message, created_at) "
        "SELECT :j, 'node.restarted', 'supervisor', 'restarted', started_at FROM workers "
        "WHERE job_id = :j AND incarnation > 0",
        j=job,
    )
    return list(
        _exec(
            conn,
            "SELECT id FROM workers WHERE job_id = :j AND status = 'alive' AND role = 'rollout'",
            j=job,
        ).scalars()
    )


def add_steps(conn: sa.Connection, job: int, tasks: list[int], first: int, last: int,
              total: int, shape: Shape) -> None:  # fmt: skip
    """``train_steps`` rows for steps [first, last], committed at the job's pace, the last of
    the ``total`` steps a minute ago."""
    metrics = ", ".join(f"'m{i}', random()" for i in range(METRIC_KEYS - 2))
    half = shape.groups // 2
    mix = {str(tasks[0]): {"groups": shape.groups - half}, str(tasks[1]): {"groups": half}}
    _exec(
        conn,
        f"""
        INSERT INTO train_steps (job_id, step, policy_version, task_mix, num_trajectories,
                                 metrics, created_at)
        SELECT :j, s, s + 1, CAST(:mix AS jsonb), :n,
               jsonb_build_object('train_s', 5.0, 'plan_s', 0.5, {metrics}),
               now() - interval '1 minute' - make_interval(secs => (:total - 1 - s) * :dt)
        FROM generate_series(CAST(:a AS integer), CAST(:b AS integer)) s
        """,
        j=job,
        mix=json.dumps(mix),
        n=shape.samples_per_step,
        total=total,
        dt=3600.0 / shape.steps_per_hour,
        a=first,
        b=last,
    )


def add_full_rows(conn: sa.Connection, job: int, tasks: list[int], first: int, last: int,
                  total: int, shape: Shape) -> None:  # fmt: skip
    """The episodes and samples steps [first, last] trained (staleness 0 or 1), an expired
    group every 20 steps whose prompt a trained episode carries, and the payloads of the last
    ``PAYLOAD_STEPS`` steps; and a quarantined episode every 100 steps since the first (they
    stay, for inspection)."""
    common = dict(j=job, t0=tasks[0], t1=tasks[1], a=first, b=last, g=shape.groups,
                  size=shape.group_size, total=total, dt=3600.0 / shape.steps_per_hour)  # fmt: skip
    at = "now() - interval '1 minute' - make_interval(secs => (:total - 1 - s) * :dt)"
    task = "CASE WHEN k % 2 = 0 THEN CAST(:t0 AS bigint) ELSE CAST(:t1 AS bigint) END"
    # expired first (smaller ids): their successors are the trained episodes of the same prompt
    _exec(
        conn,
        f"""
        INSERT INTO episodes (job_id, task_id, prompt_index, prompt, group_size, status,
                              min_policy_version, created_at, updated_at, finished_at)
        SELECT :j, {task}, s * :g + k, '{{"q": "an old prompt"}}', :size, 'expired', s - 6,
               {at}, {at}, {at}
        FROM generate_series(CAST(:a AS integer), CAST(:b AS integer)) s, (SELECT 0 AS k) k0
        WHERE s % 20 = 0
        """,
        **common,
    )
    _exec(
        conn,
        f"""
        INSERT INTO episodes (job_id, task_id, prompt_index, prompt, group_size, status,
                              attempts, last_error, created_at, updated_at)
        SELECT :j, CAST(:t1 AS bigint), -1 - s, '{{"q": "a bad prompt"}}', :size,
               'quarantined', 3, 'the agent raised', {at}, {at}
        FROM generate_series(0, CAST(:b AS integer)) s WHERE s % 100 = 0
        """,
        **common,
    )
    _exec(
        conn,
        f"""
        INSERT INTO episodes (job_id, task_id, prompt_index, prompt, group_size, status,
                              attempts, min_policy_version, claimed_step, consumed_step,
                              requeued_from, created_at, updated_at, finished_at)
        SELECT :j, {task}, s * :g + k, '{{"q": "a prompt of the task"}}', :size, 'done', 1,
               s - (k % 2), s, s,
               (SELECT x.id FROM episodes x WHERE x.job_id = :j AND x.status = 'expired'
                  AND x.prompt_index = s * :g + k AND x.task_id = {task}),
               {at}, {at}, {at}
        FROM generate_series(CAST(:a AS integer), CAST(:b AS integer)) s,
             generate_series(0, :g - 1) k
        """,
        **common,
    )
    for status, where in (
        ("consumed", "e.status = 'done'"),
        ("expired", "e.status = 'expired'"),
    ):
        _exec(
            conn,
            f"""
            INSERT INTO trajectories (task_id, episode_id, sample_index, status, lease_epoch,
                num_tokens, prompt_tokens, num_turns, turn_offsets, turn_versions,
                min_policy_version, env_state, finished, reward, reward_info, claimed_step,
                ready_at, consumed_at, payload_dropped_at)
            SELECT e.task_id, e.id, i, '{status}', 1, 1024, 200, 4, '{{0,256,512,768}}',
                   ARRAY[e.min_policy_version, e.min_policy_version, e.min_policy_version,
                         e.min_policy_version],
                   e.min_policy_version, '{{"turn": 4, "stop_reason": "stop"}}', true, random(),
                   '{{"calls": {{"replayed": 0}}}}', e.consumed_step, e.finished_at,
                   e.updated_at,
                   CASE WHEN coalesce(e.consumed_step, e.min_policy_version) < :total - :keep
                        THEN e.updated_at END
            FROM episodes e, generate_series(0, e.group_size - 1) i
            WHERE e.job_id = :j AND {where}
              AND coalesce(e.consumed_step, e.min_policy_version + 6) BETWEEN :a AND :b
            """,
            **common,
            keep=PAYLOAD_STEPS,
        )
    _exec(
        conn,
        """
        INSERT INTO trajectory_segments (task_id, episode_id, sample_index, start_token,
            end_token, lease_epoch, token_ids, loss_mask, behaviour_logprobs)
        SELECT tr.task_id, tr.episode_id, tr.sample_index, 0, 1024, 1,
               convert_to(repeat('t', 4096), 'UTF8'), convert_to(repeat('m', 1024), 'UTF8'),
               convert_to(repeat('l', 4096), 'UTF8')
        FROM trajectories tr JOIN episodes e ON e.id = tr.episode_id
        WHERE e.job_id = :j AND tr.payload_dropped_at IS NULL AND tr.status = 'consumed'
          AND e.consumed_step BETWEEN :a AND :b
        """,
        **common,
    )


def add_compacted(conn: sa.Connection, job: int, tasks: list[int], through: int,
                  shape: Shape) -> None:  # fmt: skip
    """What metadata retention leaves of steps [0, through]: the totals of the rows
    ``add_full_rows`` would have written for them."""
    steps = through + 1
    expired = (steps + 19) // 20
    half = shape.groups // 2
    per_task = {tasks[0]: shape.groups - half, tasks[1]: half}
    rows = []
    for t, groups in per_task.items():  # task 0 trains staleness 0, task 1 staleness 1
        rows.append((t, "consumed", 0 if t == tasks[0] else 1, steps * groups))
    rows.append((tasks[0], "expired", -1, expired))
    for t, state, lag, n in rows:
        _exec(
            conn,
            "INSERT INTO compacted_episodes (job_id, task_id, state, staleness, episodes, "
            "samples) VALUES (:j, :t, :s, :lag, :n, :samples)",
            j=job, t=t, s=state, lag=lag, n=n, samples=n * shape.group_size,
        )  # fmt: skip
    episodes = steps * shape.groups + expired
    _exec(
        conn,
        "INSERT INTO compacted_steps (job_id, through_step, steps, step_trajectories, "
        "consumed_trajectories, episodes, trajectories) VALUES (:j, :through, :steps, :n, :n, "
        ":e, :tr)",
        j=job, through=through, steps=steps, n=steps * shape.samples_per_step, e=episodes,
        tr=steps * shape.samples_per_step + expired * shape.group_size,
    )  # fmt: skip


def add_in_flight(conn: sa.Connection, job: int, tasks: list[int], workers: list[int],
                  total: int, shape: Shape) -> None:  # fmt: skip
    """Per task: 64 queued episodes, 8 leased (by the live rollout workers, half their samples
    checkpointed), 4 finished at the current version and waiting for the trainer."""
    _exec(conn, "UPDATE jobs SET policy_version = :v WHERE id = :j", v=total, j=job)
    for n, t in enumerate(tasks):
        base = 10_000_000 * (n + 1)
        _exec(
            conn,
            "INSERT INTO episodes (job_id, task_id, prompt_index, prompt, group_size) "
            "SELECT :j, :t, :b + i, '{\"q\": \"a new prompt\"}', :size "
            "FROM generate_series(0, 63) i",
            j=job, t=t, b=base, size=shape.group_size,
        )  # fmt: skip
        _exec(
            conn,
            "INSERT INTO episodes (job_id, task_id, prompt_index, prompt, group_size, status, "
            "lease_owner, lease_epoch, lease_expires_at, leased_at, attempts) "
            "SELECT :j, :t, :b + 100 + i, '{\"q\": \"p\"}', :size, 'leased', "
            "(CAST(:w AS bigint[]))[1 + i % cardinality(CAST(:w AS bigint[]))], 1, "
            "now() + interval '1 day', now(), 1 FROM generate_series(0, 7) i",
            j=job, t=t, b=base, size=shape.group_size, w=workers,
        )  # fmt: skip
        _exec(
            conn,
            "INSERT INTO episodes (job_id, task_id, prompt_index, prompt, group_size, status, "
            "attempts, min_policy_version, finished_at) "
            "SELECT :j, :t, :b + 200 + i, '{\"q\": \"p\"}', :size, 'done', 1, :v, now() "
            "FROM generate_series(0, 3) i",
            j=job, t=t, b=base, size=shape.group_size, v=total,
        )  # fmt: skip
    _exec(
        conn,
        """
        INSERT INTO trajectories (task_id, episode_id, sample_index, status, lease_epoch,
            num_tokens, reward, min_policy_version, ready_at)
        SELECT e.task_id, e.id, i,
               CASE WHEN e.status = 'done' THEN 'ready' ELSE 'in_progress' END
                   ::trajectory_status, 1, 512,
               CASE WHEN e.status = 'done' THEN 1.0 END, e.min_policy_version,
               CASE WHEN e.status = 'done' THEN now() END
        FROM episodes e, generate_series(0, e.group_size - 1) i
        WHERE e.job_id = :j AND e.consumed_step IS NULL AND e.status IN ('leased', 'done')
          AND (e.status = 'done' OR i < e.group_size / 2)
        """,
        j=job,
    )


def synthesize(
    url: str,
    hours: float,
    shape: Shape,
    compacted: bool,
    keep_steps: int | None = None,
    retention: bool = True,
) -> dict[str, Any]:
    """One job of ``hours`` (with ``compacted``: the steps before the last FULL_HOURS as
    retention leaves them, then the retention passes over the older full hour, keeping
    ``keep_steps``: ``buffer.metadata_retention_steps``, its default unless given; without
    ``retention``, none: every step's rows stay, as before metadata retention)."""
    total = int(hours * shape.steps_per_hour)
    full = min(total, FULL_HOURS * shape.steps_per_hour) if compacted else total
    t0 = time.perf_counter()
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with eng.begin() as conn:
        job, tasks, _ = setup_job(conn)
        workers = add_workers(conn, job, hours / 24)
        add_steps(conn, job, tasks, 0, total - 1, total, shape)
        if total > full:
            add_compacted(conn, job, tasks, total - full - 1, shape)
        add_full_rows(conn, job, tasks, total - full, total - 1, total, shape)
        add_in_flight(conn, job, tasks, workers, total, shape)
    with eng.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        _exec(conn, "VACUUM ANALYZE")
    eng.dispose()
    out: dict[str, Any] = {
        "steps": total,
        "trajectories_in_history": total * shape.samples_per_step,
        "synthesis_s": round(time.perf_counter() - t0, 1),
    }
    db = open_database(url)
    keep = BufferConfig().metadata_retention_steps if keep_steps is None else keep_steps
    config = BufferConfig(metadata_retention_steps=keep if retention else None)
    control = ControlPlaneBuffer(db, job, config)
    t1, passes, compacted_episodes = time.perf_counter(), [], 0
    while True:
        p0 = time.perf_counter()
        n = control.compact_metadata()
        if n == 0:
            break
        passes.append(time.perf_counter() - p0)
        compacted_episodes += n
    out["compaction"] = {
        "passes": len(passes),
        "episodes": compacted_episodes,
        "median_pass_ms": round(1000 * statistics.median(passes), 1) if passes else None,
        "total_s": round(time.perf_counter() - t1, 1),
    }
    with db.transaction() as tx:
        out["live_episodes"] = int(
            tx.session.execute(
                sa.text("SELECT count(*) FROM episodes WHERE job_id = :j"), {"j": job}
            ).scalar_one()
        )
    db.dispose()
    out["job_id"] = job
    return out


def sizes(url: str) -> dict[str, int]:
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with eng.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        _exec(conn, "VACUUM")
        size = "SELECT pg_database_size(current_database())"
        steps = "SELECT pg_total_relation_size('train_steps')"
        out = {
            "database": int(_exec(conn, size).scalar()),
            "train_steps": int(_exec(conn, steps).scalar()),
        }
    eng.dispose()
    return out


class Ops:
    """The timed operations on one job."""

    def __init__(self, url: str, job_id: int) -> None:
        self.url, self.job_id = url, job_id
        self.db: Database = open_database(url)
        config = BufferConfig()
        self.control = ControlPlaneBuffer(self.db, job_id, config)
        self.rollout = RolloutBuffer(self.db, job_id, config)
        self.exporter = MetricsExporter(self.db, job_id, JOB)
        with self.db.transaction() as tx:
            self.worker = int(
                tx.session.execute(
                    sa.text("SELECT min(id) FROM workers WHERE job_id = :j AND status = 'alive'"),
                    {"j": job_id},
                ).scalar_one()
            )

    def metrics(self) -> None:
        self.exporter.refresh()
        assert self.exporter._errors == 0, "the metrics collection failed"

    def status(self) -> None:
        with self.db.transaction() as tx:
            status_document(tx, JOB)

    def sweep(self) -> None:
        self.control.sweep_expired_leases()
        self.control.expire_stale()
        self.control.sweep_dead_workers(1e9, 1e9)

    def claim(self) -> float:
        t = time.perf_counter()
        c = self.rollout.claim(self.worker)
        dt = time.perf_counter() - t
        assert c is not None, "nothing to claim"
        self.rollout.release(c.lease, "bench", counted=False)
        return dt

    def invariants(self) -> None:
        report = check_invariants(self.db, self.job_id)
        assert report.ok, report.summary()

    def upgrade(self) -> None:
        code = "import sys; from rollcall.orchestrator.cli import main; sys.exit(main())"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        r = subprocess.run(
            [sys.executable, "-c", code, "--database-url", self.url, "db", "upgrade"],
            env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]

    def close(self) -> None:
        self.db.dispose()


OPERATIONS = ("metrics", "status", "sweep", "claim", "invariants", "upgrade")


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    out = fn()
    return float(out) if isinstance(out, float) else time.perf_counter() - t


def compare(
    aged: Ops, fresh: Ops, repeats: int, operations: tuple[str, ...] = OPERATIONS
) -> dict[str, dict[str, float]]:
    """Each operation's medians on both jobs and their ratio (each at least FLOOR_MS)."""
    out = {}
    for name in operations:
        n = max(3, repeats // 3) if name == "upgrade" else repeats
        times: dict[str, list[float]] = {"aged": [], "fresh": []}
        for ops in (aged, fresh):
            timed(getattr(ops, name))  # warm-up, not counted
        for _ in range(n):  # alternated, so the machine's load falls on both alike
            for key, ops in (("aged", aged), ("fresh", fresh)):
                times[key].append(1000 * timed(getattr(ops, name)))
        a, f = statistics.median(times["aged"]), statistics.median(times["fresh"])
        out[name] = {
            "aged_ms": round(a, 2),
            "fresh_ms": round(f, 2),
            "ratio": round(max(a, FLOOR_MS) / max(f, FLOOR_MS), 3),
            "repeats": n,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--days", type=float, default=14.0)
    ap.add_argument("--steps-per-hour", type=int, default=540)
    ap.add_argument("--samples-per-step", type=int, default=48)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--fresh-hours", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="2 days, 5 repeats: a smoke run")
    ap.add_argument(
        "--no-retention",
        action="store_true",
        help="the aged job without metadata retention (every step's rows kept, as before "
        "migration 0011): what its age costs then; use a shorter --days",
    )
    ap.add_argument("--json", action="store_true", help="one JSON object as the last line")
    args = ap.parse_args()
    if args.quick:
        args.days, args.repeats = min(args.days, 2.0), min(args.repeats, 5)
    shape = Shape(args.steps_per_hour, args.samples_per_step, args.group_size)
    home = Path(tempfile.mkdtemp(prefix="rc-hist-", dir="/tmp"))
    home.chmod(0o711)  # as root, the server's user passes through it
    server = EmbeddedPostgres(home)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "days": args.days,
        "steps_per_hour": shape.steps_per_hour,
        "samples_per_step": shape.samples_per_step,
        "fresh_hours": args.fresh_hours,
        "retention": not args.no_retention,
        "floor_ms": FLOOR_MS,
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg()[0],
    }
    ops: list[Ops] = []
    try:
        server.ensure_running()
        admin = sa.create_engine(server.url(role=SUPERUSER), poolclass=sa.pool.NullPool)
        urls = {}
        with admin.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            for name in ("aged", "fresh"):
                _exec(conn, f"CREATE DATABASE hist_{name}")
                urls[name] = server.url(database=f"hist_{name}", role=SUPERUSER)
        admin.dispose()
        for url in urls.values():
            eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
            with eng.connect() as conn:
                migrate.upgrade(conn)
                conn.commit()
            eng.dispose()
        hours = {"aged": args.days * 24, "fresh": args.fresh_hours}
        jobs = {}
        for name, url in urls.items():
            aged = name == "aged"
            jobs[name] = synthesize(
                url,
                hours[name],
                shape,
                compacted=aged and not args.no_retention,
                retention=not (aged and args.no_retention),
            )
            jobs[name]["bytes"] = sizes(url)
            print(f"# {name}: {json.dumps(jobs[name])}", flush=True)
        result["jobs"] = jobs
        aged_bytes = jobs["aged"]["bytes"]["train_steps"]
        result["bytes_per_day_after_the_window"] = round(
            aged_bytes / jobs["aged"]["steps"] * shape.steps_per_hour * 24
        )
        ops = [Ops(urls[n], jobs[n]["job_id"]) for n in ("aged", "fresh")]
        result["operations"] = compare(ops[0], ops[1], args.repeats)
    finally:
        for o in ops:
            o.close()
        server.stop()
        shutil.rmtree(home, ignore_errors=True)
    result["load_after"] = os.getloadavg()[0]
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["ok"] = all(o["ratio"] <= GOAL for o in result["operations"].values())
    print(f"{'operation':<12} {'aged ms':>9} {'fresh ms':>9} {'ratio':>7}")
    for name, o in result["operations"].items():
        print(f"{name:<12} {o['aged_ms']:>9.2f} {o['fresh_ms']:>9.2f} {o['ratio']:>7.2f}")
    print(f"# every ratio at most {GOAL}: {result['ok']} ({result['wall_s']} s)")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
