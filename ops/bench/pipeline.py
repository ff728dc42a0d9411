"""Benchmark of the whole pipeline, async against sync, on a long-tail agent workload.

The real orchestrator runs: the job driver (``JobDriver``) with its PostgreSQL buffer, leases,
admission, staleness bounds, fair claims, step commits and weight-version bookkeeping, the
APScheduler control-plane jobs, rollout nodes as Ray actors with their agent loops, tool
processes, per-turn checkpoints and heartbeats. Two seams are timing models, named as such:

- the engine is ``rollout.engine.kind: timing_model`` (``workers/rollout/engines/timing.py``):
  it sleeps a modelled prefill + decode time per turn and returns a well-formed tool call;
- the trainer is ``trainer.timing_model`` (``workers/trainer/timing.py``): it sleeps a modelled
  time per step, proportional to the batch's tokens, then checkpoints and publishes small
  files through the normal path;

and the tasks are the ``longtail`` timing-model plugin (``tasks/longtail.py``): 5-50 turns,
800-12,000 tokens, heavy-tailed (log-normal) tool latency, with several profiles.

All modelled durations are simulated seconds, slept as ``--scale`` real seconds each (default
0.02: one simulated second is 20 ms). Everything the orchestrator itself does (database calls,
Ray calls, Python) takes real time, so at the benchmark's scale its share of the wall time is
inflated by 1/scale against a real deployment; both figures are reported.

Before a run, the same engine and task code runs in-process without sleeping (a dry run of
``--dry`` trajectories per task) to get the profile's distributions, from which the benchmark
calibrates the trainer (training a batch takes 1/``--ratio`` of the sync rollout of a batch;
rollout time about 10x training time) and computes each mode's theoretical bound.

Modes: ``compare`` (default; sync then async on the same resources), ``scaling`` (async with
1, 2, 4, 8, 16 rollout nodes and 1, 4, 16 tasks: claim latency, control-plane and PostgreSQL
CPU per trajectory, WAL bytes, the machine's busy share and throughput; ``--concurrency 64``
makes 16 nodes a 1,024-loop fleet), ``async``/``sync`` (one run).

Usage: python ops/bench/pipeline.py [--quick] [--mode compare|scaling|async|sync] [--scale 0.02]
       [--nodes 4] [--concurrency 16] [--tasks 4] [--batch-groups 8] [--group-size 4]
       [--tool-level sandbox|process] [--json]
Prints a table, then (last line) one JSON object with the figures; ``--mode scaling --json``
prints one JSON object per point instead (nodes, loops, rate, of_bound,
control_plane_cpu_ms_per_traj, postgres_cpu_ms_per_traj, node_cpu_ms_per_traj,
wal_kb_per_traj, writes_per_transaction and the rest of the row).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ops.bench.pipeline_bounds import Bounds, Sample, compute_bounds, mode_bound
from ops.bench.pipeline_costs import Monitor, Snap, control_plane, window_costs
from rollcall.orchestrator import rayauth
from rollcall.orchestrator.config import RollcallConfig, TimingEngineConfig, TimingTrainerConfig
from rollcall.orchestrator.runner.rundir import RunDir
from rollcall.tasks.longtail import LongtailSpec, LongtailTask
from rollcall.workers.trainer.timing import step_seconds

# Task profiles (simulated seconds): several kinds of agent work with different tails.
PROFILES: dict[str, dict[str, Any]] = {
    # a general tool-using agent: 5-50 turns, tools of ~1 s with a heavy tail
    "agentic": dict(turns_min=5, turns_max=50, tool_median_s=1.0, tool_sigma=1.0,
                    obs_tokens_min=40, obs_tokens_max=400),
    # web search: long observations, slow and very heavy-tailed tools
    "search": dict(turns_min=5, turns_max=40, tool_median_s=2.0, tool_sigma=1.3,
                   obs_tokens_min=100, obs_tokens_max=500),
    # code sandbox: fewer turns, slow tools (execution), short outputs
    "sandbox": dict(turns_min=5, turns_max=30, tool_median_s=3.0, tool_sigma=0.8,
                    obs_tokens_min=20, obs_tokens_max=250),
    # quick lookups: short episodes, fast tools
    "lookup": dict(turns_min=5, turns_max=15, tool_median_s=0.3, tool_sigma=0.5,
                   obs_tokens_min=20, obs_tokens_max=120),
}  # fmt: skip
ORDER = ("agentic", "search", "sandbox", "lookup")
MAX_TOKENS = 12_000
MAX_TOKENS_PER_TURN = 512


@dataclass
class Setup:
    mode: str = "async"
    nodes: int = 4
    concurrency: int = 16
    tasks: int = 4
    batch_groups: int = 8
    group_size: int = 4
    max_staleness: int = 4
    scale: float = 0.02
    steps: int = 30
    warmup: int = 4
    ratio: float = 10.0  # sync rollout time of a batch / training time of a batch
    tool_level: str = "sandbox"  # rollout.tool_sandbox.level
    engine: dict[str, Any] = field(default_factory=dict)  # TimingEngineConfig overrides
    trainer: dict[str, Any] = field(default_factory=dict)  # TimingTrainerConfig overrides

    def engine_config(self) -> TimingEngineConfig:
        return TimingEngineConfig(time_scale=self.scale, **self.engine)

    def trainer_config(self) -> TimingTrainerConfig:
        return TimingTrainerConfig(time_scale=self.scale, **self.trainer)

    def task_specs(self) -> list[tuple[str, dict[str, Any]]]:
        out = []
        for i in range(self.tasks):
            profile = ORDER[i % len(ORDER)]
            spec = {**PROFILES[profile], "group_size": self.group_size, "seed": i,
                    "time_scale": self.scale}  # fmt: skip
            out.append((f"{profile}-{i}" if self.tasks > len(ORDER) else profile, spec))
        return out


# -- the profile, measured by a dry run of the same code ------------------------------------


def dry_run(setup: Setup, model_dir: Path, per_task: int) -> dict[str, list[Sample]]:
    """Trajectories of every task played by the real agent loop, timing engine and task code,
    with the sleeps recorded instead of slept (batch of one, so no decode slowdown)."""
    from rollcall.workers.episode.chat import chat_for
    from rollcall.workers.episode.play import player
    from rollcall.workers.episode.tools import ToolResult, ToolRunner
    from rollcall.workers.episode.trajectory import Limits
    from rollcall.workers.rollout.engines.timing import TimingEngine

    slept: list[float] = []

    class DryLongtail(LongtailTask):
        sleep = staticmethod(slept.append)

    class InProcess(ToolRunner):  # the tool called in this process, no child, no timeout
        def call(
            self,
            plugin: Any,
            spec: Any,
            prompt: Any,
            state: Any,
            name: str,
            arguments: Any,
            network: bool = False,
        ) -> ToolResult:
            obs = plugin.call_tool(spec, prompt, state, name, arguments)
            return ToolResult(obs.text, obs.state, obs.done, False)

    engine = TimingEngine(
        setup.engine_config().model_copy(update={"time_scale": 1.0}),
        model_dir,
        seed=12345,
        sleep=slept.append,
    )
    task = DryLongtail()
    out: dict[str, list[Sample]] = {}
    for name, spec_data in setup.task_specs():
        spec = LongtailSpec.model_validate({**spec_data, "time_scale": 1.0})
        samples = []
        for i in range(per_task):
            slept.clear()
            limits = Limits(spec.max_turns, MAX_TOKENS_PER_TURN, MAX_TOKENS)
            loop = player(
                engine, chat_for(engine.tokenizer), task, spec, task.prompt(spec, 10**6 + i),
                InProcess(), limits,
            )  # fmt: skip
            o = loop.run()
            samples.append(Sample(sum(slept), len(o.trajectory.token_ids), o.turns))
        out[name] = samples
    return out


def calibrate(setup: Setup, profile: dict[str, list[Sample]], parallel: bool) -> Setup:
    """Set the trainer's per-token time so that a batch trains in 1/ratio of its sync
    rollout (the workload's defining ratio), unless the caller fixed it."""
    if "s_per_token" in setup.trainer:
        return setup
    probe = compute_bounds(setup, profile, parallel)
    t = setup.trainer_config()
    target = probe.sync_rollout_s / setup.ratio - t.step_s - t.checkpoint_s - t.publish_s
    per_token = max(0.0, target) / probe.batch_tokens
    return replace(setup, trainer={**setup.trainer, "s_per_token": per_token})


# -- one run of the real orchestrator ---------------------------------------------------------


def config_for(setup: Setup, name: str, url: str, run_dir: Path) -> RollcallConfig:
    tasks = [
        {"name": n, "plugin": "longtail", "weight": 1.0, "max_inflight": 10_000,
         "max_staleness": setup.max_staleness, "spec": spec}
        for n, spec in setup.task_specs()
    ]  # fmt: skip
    # Timeouts in real seconds, so they follow the time scale: the longest modelled tool call
    # (tool_cap_s) and turn must not be taken for a hung tool or node. At a large scale (1,000
    # loops: 3 real seconds per simulated one) the defaults (5 s, 30 s) would kill tool
    # processes mid-call and restart them, which is the benchmark's fault, not the workload's.
    tool_cap_s = LongtailSpec.model_fields["tool_cap_s"].default
    tool_timeout_s = tool_cap_s * setup.scale * 1.5 + 5.0
    e = setup.engine_config()
    turn_s = (e.turn_tokens_max * e.decode_s_per_token + MAX_TOKENS * e.prefill_s_per_token) * (
        setup.scale
    )
    progress_timeout_s = tool_timeout_s + 10.0 + max(30.0, 4 * turn_s)
    return RollcallConfig.model_validate(
        {
            "job": {"name": name},
            "database": {"url": url},
            "buffer": {"batch_groups": setup.batch_groups, "lease_s": 120},
            # logical CPUs: the actors sleep; the operating system shares the real cores
            "ray": {"num_cpus": 4},
            "rollout": {
                "nodes": setup.nodes,
                "concurrency": setup.concurrency,
                "cpus_per_node": 0.1,
                "engine": setup.engine_config().model_dump(),
                "max_tokens_per_turn": MAX_TOKENS_PER_TURN,
                "max_tokens": MAX_TOKENS,
                "start_timeout_s": 300,
                "tool_timeout_s": tool_timeout_s,
                "tool_sandbox": {"level": setup.tool_level},
            },
            "control_plane": {"progress_timeout_s": progress_timeout_s},
            "trainer": {"cpus_per_rank": 0.1, "timing_model": setup.trainer_config().model_dump()},
            "run": {"mode": setup.mode, "total_steps": setup.steps, "dir": str(run_dir),
                    "eval": {"every": 0, "episodes": 0}},
            "tasks": tasks,
        }
    )  # fmt: skip


def run_job(setup: Setup, url: str, home: Path, model_dir: Path, name: str) -> dict[str, Any]:
    from rich.console import Console

    from rollcall.orchestrator.db.engine import open_database
    from rollcall.orchestrator.runner.driver import JobDriver

    run_dir = home / "runs" / name
    cfg = config_for(setup, name, url, run_dir)
    db = open_database(url)
    log = (home / f"{name}.log").open("w")  # the driver's own output
    driver = JobDriver(
        cfg, db, model_dir=model_dir, home=home, console=Console(file=log), live=False
    )
    pgdata = home / "postgres" / "data"
    monitor = Monitor(driver, pgdata)
    uptime0 = load_average()
    try:
        driver.setup()
        stop_nodes = driver._stop_nodes

        def snap_then_stop() -> None:
            monitor.final()
            stop_nodes()

        driver._stop_nodes = snap_then_stop  # type: ignore[method-assign]
        commit_step = driver.trainer_buffer.commit_step

        def commit_then_mark(step: int, **kw: Any) -> Any:
            out = commit_step(step, **kw)
            monitor.committed(step + 1)
            return out

        driver.trainer_buffer.commit_step = commit_then_mark  # type: ignore[method-assign]
        monitor.start()
        result = driver.run()
        monitor.done.set()
        monitor.join()
        with db.transaction() as tx:
            steps = tx.monitoring.steps_after(driver.job_id, -1)
            staleness = tx.monitoring.trained_staleness(driver.job_id)
            task_views = tx.tasks.list(driver.job_id)
            counters = [t.counters for t in task_views]
            names = {t.id: t.name for t in task_views}
    finally:
        monitor.done.set()
        driver.close()
        db.dispose()
        log.close()
    records = {r["step"]: r for r in RunDir(run_dir).records("step")}
    trained = {names[t]: sum(per.values()) for t, per in staleness.items()}
    return summarise(
        setup, result, monitor.snaps, steps, staleness, counters, records, monitor.driver_ops_at
    ) | {
        "trained_groups_by_task": trained,
        "load_before": uptime0,
        "load_after": load_average(),
    }


def realized_mix(run: dict[str, Any]) -> dict[str, float]:
    by_task = run["trained_groups_by_task"]
    total = sum(by_task.values()) or 1
    return {k: v / total for k, v in by_task.items()}


BUSY_PHASES = ("train_s", "checkpoint_s", "publish_s")


def summarise(
    setup: Setup,
    result: Any,
    snaps: dict[int, Snap],
    steps: list[Any],
    staleness: dict[int, dict[int, int]],
    counters: list[dict[str, int]],
    records: dict[int, dict[str, Any]],
    driver_ops_at: dict[int, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The run's figures over its measured window: from the commit of step ``warmup - 1``
    (or the first commit) to the last one, on the database clock."""
    w = max(1, min(setup.warmup, setup.steps - 1))
    by_step = {s.step: s for s in steps}
    inside = [s for s in steps if s.step >= w]
    span = by_step[max(by_step)].at - by_step[w - 1].at
    trained = sum(s.num_trajectories for s in inside)
    busy = sum(float(s.metrics.get(k, 0.0)) for s in inside for k in BUSY_PHASES)
    # the timing trainer's modelled seconds of the same steps: what the bound counts, without
    # the real costs of its calls (Ray, files) or the loop between steps
    t = setup.trainer_config()
    modelled = setup.scale * sum(
        step_seconds(t, int(s.metrics.get("tokens_trained", 0))) + t.checkpoint_s + t.publish_s
        for s in inside
    )
    per_step = {
        k: sum(float(records.get(s.step, {}).get(k, 0.0)) for s in inside) / len(inside)
        for k in ("plan_s", "train_s", "checkpoint_s", "publish_s", "commit_s")
    }
    lags: dict[int, int] = {}
    for per_task in staleness.values():
        for lag, n in per_task.items():
            lags[lag] = lags.get(lag, 0) + n
    groups = sum(lags.values())
    expired = sum(c.get("expired_groups", 0) for c in counters)
    # control-plane costs between the snapshots taken at the window's ends
    first = snaps.get(w) or snaps[min(k for k in snaps if k >= w)]
    if driver_ops_at and w in driver_ops_at:  # exact even where the monitor missed step w
        first = replace(first, driver_ops=driver_ops_at[w])
    last = snaps[max(snaps)]
    costs = window_costs(first, last)
    return {
        "mode": setup.mode,
        "steps": result.steps,
        "window_steps": len(inside),
        "wall_s": result.wall_s,
        "window_s": span,
        "trained": trained,
        "traj_per_h_real": trained / span * 3600,
        "traj_per_s_sim": trained / (span / setup.scale),
        "busy": busy / span,
        "modelled_busy": modelled / span,
        "modelled_step_s_sim": modelled / setup.scale / max(1, len(inside)),
        "busy_run": result.busy_frac,
        "per_step_s": per_step,
        "staleness": dict(sorted(lags.items())),
        "staleness_mean": sum(k * n for k, n in lags.items()) / groups if groups else 0.0,
        "trained_groups": groups,
        "expired_groups": expired,
        "expired_frac": expired / (expired + groups) if expired + groups else 0.0,
        "cp": control_plane(setup, costs, last.at - first.at, last.step - first.step),
        "pg_processes_max": max(x.pg_processes for x in snaps.values()),
    }


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- main -------------------------------------------------------------------------------------


def start_database(home: Path, statements: bool = False) -> str:
    """The benchmark's embedded server, migrated; ``statements``: with pg_stat_statements
    loaded (every statement, those inside functions too), for ``--pg-statements``."""
    from rollcall.orchestrator.db import migrate
    from rollcall.orchestrator.db.embedded import MIGRATOR, EmbeddedPostgres
    from rollcall.orchestrator.db.engine import open_database

    server = EmbeddedPostgres(home)
    url = server.ensure_running()
    if statements:
        with _superuser(home) as conn:
            conn.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
            conn.execute("ALTER SYSTEM SET pg_stat_statements.track = 'all'")
        server.stop()
        url = server.ensure_running()
        with _superuser(home) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    db = open_database(server.url(role=MIGRATOR), verify_schema=False)  # migrations
    with db.engine.connect() as conn:
        migrate.upgrade(conn)
        conn.commit()
    db.dispose()
    return url


@contextlib.contextmanager
def _superuser(home: Path) -> Iterator[Any]:
    import psycopg

    from rollcall.orchestrator.db.embedded import SUPERUSER, EmbeddedPostgres

    url = EmbeddedPostgres(home).url(role=SUPERUSER).replace("postgresql+psycopg", "postgresql")
    with psycopg.connect(url, autocommit=True) as conn:
        yield conn


def print_statements(home: Path, top: int) -> None:
    """The ``top`` statements by the server's time since the last call (pg_stat_statements),
    then reset: where PostgreSQL's time goes in a run."""
    with _superuser(home) as conn:
        rows = conn.execute(
            "SELECT calls, total_exec_time, regexp_replace(query, '\\s+', ' ', 'g') "
            "FROM pg_stat_statements ORDER BY total_exec_time DESC LIMIT %s",
            (top,),
        ).fetchall()
        conn.execute("SELECT pg_stat_statements_reset()")
    print("# PostgreSQL's time by statement (calls, total ms, us per call, statement)")
    for calls, total_ms, query in rows:
        print(
            f"{calls:>8} {total_ms:>10.1f} {1000 * total_ms / max(1, calls):>9.1f}  {query[:110]}"
        )


def tokenizer_dir(home: Path) -> Path:
    """The tiny model's tokenizer only (the timing engine loads nothing else)."""
    from rollcall.workers.tiny_model import build_tokenizer

    out = home / "tokenizer"
    if not (out / "tokenizer.json").exists():
        build_tokenizer().save_pretrained(out)
    return out


def describe(setup: Setup, b: Bounds) -> str:
    return (
        f"{setup.nodes} nodes x {setup.concurrency} loops, {setup.tasks} task(s), batch "
        f"{setup.batch_groups} groups x {setup.group_size}, max_staleness {setup.max_staleness}, "
        f"scale {setup.scale * 1000:g} ms per simulated s; profile: trajectory {b.traj_s:.1f} s, "
        f"group {b.group_span_s:.1f} s, sync rollout of a batch {b.sync_rollout_s:.1f} s, "
        f"train step {b.train_s:.1f} s (ratio {b.sync_rollout_s / b.train_s:.1f})"
    )


def print_compare(setup: Setup, b: Bounds, runs: dict[str, dict[str, Any]]) -> None:
    print(describe(setup, b))
    head = ("mode", "traj/h (sim)", "bound", "eff", "bound (mix)", "eff (mix)", "busy",
            "bound (trained)", "eff (trained)", "stale mean", "expired", "cp rollout", "cp driver",
            "cp trainer path", "cp cpu ms/traj", "claim p50/p99 ms", "load")  # fmt: skip
    print(" | ".join(head))
    for mode, r in runs.items():
        bound, mixed = mode_bound(b, mode), r["bound_mix_traj_per_s"]
        cells = [
            mode,
            f"{r['traj_per_s_sim'] * 3600:,.0f}",
            f"{bound * 3600:,.0f}",
            f"{r['traj_per_s_sim'] / bound:.1%}",
            f"{mixed * 3600:,.0f}",
            f"{r['traj_per_s_sim'] / mixed:.1%}",
            f"{r['busy']:.1%}",
            f"{r['bound_trained_traj_per_s'] * 3600:,.0f}",
            f"{r['traj_per_s_sim'] / r['bound_trained_traj_per_s']:.1%}",
            f"{r['staleness_mean']:.2f}",
            f"{r['expired_frac']:.1%}",
            f"{r['cp']['rollout_share']:.2%}",
            f"{r['cp']['driver_share']:.2%}",
            f"{r['cp']['trainer_path_share']:.2%}",
            f"{r['cp']['cpu_ms_per_traj']:.1f}",
            f"{r['cp']['claim_p50_ms']}/{r['cp']['claim_p99_ms']}",
            "/".join(f"{x:g}" for x in r["load_after"]),
        ]
        print(" | ".join(cells))
    if "sync" in runs and "async" in runs:
        s = runs["async"]["traj_per_s_sim"] / runs["sync"]["traj_per_s_sim"]
        print(f"speedup async/sync: {s:.2f}x (bound {b.async_traj_per_s / b.sync_traj_per_s:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--mode", choices=("compare", "scaling", "async", "sync", "bounds"), default="compare"
    )
    ap.add_argument("--quick", action="store_true", help="a smoke run (small, about 30 s)")
    ap.add_argument("--scale", type=float, default=0.02, help="real seconds per simulated second")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--batch-groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-staleness", type=int, default=4)
    ap.add_argument("--steps-async", type=int, default=40)
    ap.add_argument("--steps-sync", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=4, help="steps before the measured window")
    ap.add_argument("--ratio", type=float, default=10.0, help="sync rollout / train time")
    ap.add_argument(
        "--tool-level",
        choices=("sandbox", "process"),
        default="sandbox",
        help="rollout.tool_sandbox.level of the jobs (default: the default, sandbox)",
    )
    ap.add_argument("--dry", type=int, default=400, help="dry-run trajectories per task")
    ap.add_argument(
        "--sequential-groups",
        action="store_true",
        help="bounds for nodes that roll a group's samples one after another",
    )
    ap.add_argument(
        "--rate",
        type=float,
        default=3.0,
        help="scaling: rollout capacity in trajectories per real second",
    )
    ap.add_argument("--grid-nodes", default="1,2,4,8,16")
    ap.add_argument("--grid-tasks", default="1,4,16")
    ap.add_argument("--grid-steps", type=int, default=8, help="scaling: measured steps")
    ap.add_argument(
        "--settle",
        type=float,
        default=1.5,
        help="scaling: warm-up of at least this many trajectory durations (the ramp)",
    )
    ap.add_argument(
        "--json",
        action="store_true",
        help="scaling: one JSON object per point (a line each) instead of the table and the "
        "final object",
    )
    ap.add_argument(
        "--pg-statements",
        type=int,
        default=0,
        metavar="N",
        help="load pg_stat_statements and print the N statements PostgreSQL spent most time "
        "on after each run (a profile; it costs the server some CPU)",
    )
    ap.add_argument("--home", type=Path, default=None, help="default: a temporary folder")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args()

    base = Setup(
        nodes=args.nodes, concurrency=args.concurrency, tasks=args.tasks,
        batch_groups=args.batch_groups, group_size=args.group_size,
        max_staleness=args.max_staleness, scale=args.scale, warmup=args.warmup, ratio=args.ratio,
        tool_level=args.tool_level,
    )  # fmt: skip
    steps = {"async": args.steps_async, "sync": args.steps_sync}
    if args.quick:
        base = replace(base, nodes=2, concurrency=8, tasks=2, batch_groups=4, group_size=2,
                       warmup=1, scale=min(args.scale, 0.01))  # fmt: skip
        steps = {"async": 4, "sync": 2}
        args.dry = min(args.dry, 60)
    parallel = not args.sequential_groups
    home = args.home
    if home is None:
        home = Path(tempfile.mkdtemp(prefix="rc-bench-", dir="/tmp"))
        home.chmod(0o711)  # as root, the embedded server's user passes through it
    rayauth.configure_local()  # token authentication, as a job's local Ray
    try:
        url = start_database(home, statements=bool(args.pg_statements))
        model_dir = tokenizer_dir(home)
        out: dict[str, Any] = {
            "benchmark": "pipeline",
            "mode": args.mode,
            "scale": base.scale,
            "load_start": load_average(),
            "parallel_groups": parallel,
        }
        if args.mode == "scaling":
            out.update(scaling(base, args, url, home, model_dir, parallel))
        else:
            profile = dry_run(base, model_dir, args.dry)
            setup = calibrate(base, profile, parallel)
            b = compute_bounds(setup, profile, parallel)
            if args.mode == "bounds":  # the profile and the bounds only, no run
                print(describe(setup, b))
                for k, v in asdict(b).items():
                    print(f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}")
                out.update(setup=asdict(setup), bounds=asdict(b), profile=profile_stats(profile))
                out["load_end"] = load_average()
                print(json.dumps(out, default=str))
                return
            modes = ("sync", "async") if args.mode == "compare" else (args.mode,)
            runs = {}
            for m in modes:
                s = replace(setup, mode=m, steps=steps[m], warmup=min(setup.warmup, steps[m] - 1))
                r = run_job(s, url, home, model_dir, f"bench-{m}-{int(time.time())}")
                mixed = compute_bounds(s, profile, parallel, mix=realized_mix(r))
                r["bounds_mix"] = asdict(mixed)
                r["bound_mix_traj_per_s"] = mode_bound(mixed, m)
                trained = compute_bounds(s, profile, parallel, train_s=r["modelled_step_s_sim"])
                r["bound_trained_traj_per_s"] = mode_bound(trained, m)
                runs[m] = r
            print_compare(setup, b, runs)
            out.update(setup=asdict(setup), bounds=asdict(b), runs=runs)
            out["profile"] = profile_stats(profile)
            if "sync" in runs and "async" in runs:
                out["speedup"] = runs["async"]["traj_per_s_sim"] / runs["sync"]["traj_per_s_sim"]
        out["load_end"] = load_average()
    finally:
        stop_database(home)
        if args.home is None and not args.keep:
            shutil.rmtree(home, ignore_errors=True)
    if not (args.json and args.mode == "scaling"):  # --json printed each point already
        print(json.dumps(out, default=str))


def profile_stats(profile: dict[str, list[Sample]]) -> dict[str, Any]:
    out = {}
    for name, ss in profile.items():
        secs = sorted(s.seconds for s in ss)
        toks = sorted(s.tokens for s in ss)
        turns = sorted(s.turns for s in ss)
        out[name] = {
            "seconds": _q(secs), "tokens": _q(toks), "turns": _q(turns),
        }  # fmt: skip
    return out


def _q(xs: list[float] | list[int]) -> dict[str, float]:
    n = len(xs)
    return {"min": xs[0], "p50": xs[n // 2], "mean": round(statistics.mean(xs), 2),
            "p99": xs[min(n - 1, int(0.99 * n))], "max": xs[-1]}  # fmt: skip


def stop_database(home: Path) -> None:
    from rollcall.orchestrator.db.embedded import EmbeddedPostgres

    with contextlib.suppress(Exception):
        EmbeddedPostgres(home).stop()


def scaling(
    base: Setup, args: Any, url: str, home: Path, model_dir: Path, parallel: bool
) -> dict[str, Any]:
    """Async runs over a grid of rollout nodes x tasks at a constant real load: each
    configuration's time scale is chosen so that its rollout capacity is ``--rate`` trajectories
    per real second, and its trainer is 1.5x faster than that capacity (rollout-bound), so
    every configuration does the same real work per second and only the orchestrator's own
    costs can differ: claim latency, control-plane time and CPU per trajectory, and whether
    throughput keeps up with the bound (efficiency)."""
    rows = []
    nodes_grid = [int(x) for x in args.grid_nodes.split(",")]
    tasks_grid = [int(x) for x in args.grid_tasks.split(",")]
    profiles: dict[int, dict[str, list[Sample]]] = {}
    for tasks in tasks_grid:
        for nodes in nodes_grid:
            setup = replace(base, nodes=nodes, tasks=tasks, mode="async")
            if tasks not in profiles:
                profiles[tasks] = dry_run(setup, model_dir, args.dry)
            profile = profiles[tasks]
            loops = nodes * setup.concurrency
            probe = compute_bounds(setup, profile, parallel)
            scale = loops / (probe.traj_s * args.rate)
            # versions advance once per batch; a group spans span / (batch / capacity) of them
            per_version_s = setup.batch_groups * setup.group_size * probe.traj_s / loops
            staleness = math.ceil(2 * probe.group_span_s / per_version_s) + 2
            train_s = per_version_s / 1.5
            # every loop starts at once, so completions ramp up over about one trajectory's
            # duration (loops / rate real seconds); the window starts after --settle of them
            settle_steps = math.ceil(args.settle * loops / (setup.batch_groups * setup.group_size))
            setup = replace(setup, warmup=max(setup.warmup, settle_steps))
            t = setup.trainer_config()
            per_token = max(0.0, train_s - t.step_s - t.checkpoint_s - t.publish_s) / max(
                1.0, probe.batch_tokens
            )
            steps = args.grid_steps + setup.warmup
            setup = replace(
                setup, scale=scale, max_staleness=staleness, steps=steps,
                trainer={**setup.trainer, "s_per_token": per_token},
            )  # fmt: skip
            b = compute_bounds(setup, profile, parallel)
            r = run_job(setup, url, home, model_dir, f"scale-n{nodes}-t{tasks}-{int(time.time())}")
            if args.pg_statements:
                print_statements(home, args.pg_statements)
            mixed = compute_bounds(setup, profile, parallel, mix=realized_mix(r))
            row = {
                "nodes": nodes, "tasks": tasks, "loops": loops, "scale": scale,
                "max_staleness": staleness, "bound_traj_per_s_sim": b.async_traj_per_s,
                "bound_mix_traj_per_s_sim": mixed.async_traj_per_s,
                "limited_by": b.async_limited_by, **_row(r, b),
                "efficiency_mix": r["traj_per_s_sim"] / mixed.async_traj_per_s,
            }  # fmt: skip
            rows.append(row)
            if args.json:
                print(json.dumps(point_json(row, args.rate)), flush=True)
            else:
                print_scaling_row(row, header=len(rows) == 1)
    return {"scaling": rows, "rate_per_real_s": args.rate}


def _row(r: dict[str, Any], b: Bounds) -> dict[str, Any]:
    cp = r["cp"]
    return {
        "traj_per_h_sim": r["traj_per_s_sim"] * 3600,
        "traj_per_s_real": r["trained"] / r["window_s"],
        "efficiency": r["traj_per_s_sim"] / b.async_traj_per_s,
        "claim_p50_ms": cp["claim_p50_ms"],
        "claim_p99_ms": cp["claim_p99_ms"],
        "claim_mean_ms": cp["claim_mean_ms"],
        "claims_per_traj": cp["claim_calls"] / max(1, cp["trajectories"]),
        "cp_wall_ms_per_traj": cp["rollout_wall_ms_per_traj"] + cp["driver_wall_ms_per_traj"],
        "cp_cpu_ms_per_traj": cp["cpu_ms_per_traj"],
        "pg_cpu_ms_per_traj": cp["pg_cpu_ms_per_traj"],
        "node_cpu_ms_per_traj": cp["node_process_cpu_ms_per_traj"],
        "wal_kb_per_traj": cp["wal_kb_per_traj"],
        "wal_mb_per_s": cp["wal_mb_per_s"],
        "writes_per_transaction": cp["writes_per_transaction"],
        "machine_busy": cp["machine_busy"],
        "expired_frac": r["expired_frac"],
        "staleness_mean": r["staleness_mean"],
        "load": r["load_after"],
        "ops": cp["ops"],
    }


def point_json(row: dict[str, Any], rate: float) -> dict[str, Any]:
    """A scaling point as ``--json`` prints it: the issue's names first, then the rest."""
    return {
        "nodes": row["nodes"],
        "loops": row["loops"],
        "tasks": row["tasks"],
        "rate": rate,
        "traj_per_s_real": row["traj_per_s_real"],
        "of_bound": row["efficiency"],
        "control_plane_cpu_ms_per_traj": row["cp_cpu_ms_per_traj"],
        "postgres_cpu_ms_per_traj": row["pg_cpu_ms_per_traj"],
        "node_cpu_ms_per_traj": row["node_cpu_ms_per_traj"],
        "wal_kb_per_traj": row["wal_kb_per_traj"],
        "writes_per_transaction": row["writes_per_transaction"],
        **{k: v for k, v in row.items() if k not in ("efficiency", "ops")},
        "ops": row["ops"],
    }


def print_scaling_row(row: dict[str, Any], *, header: bool) -> None:
    cols = ("nodes", "tasks", "loops", "traj/h (sim)", "real/s", "eff", "eff (mix)",
            "claim p50/p99 ms",
            "claims/traj", "cp ms/traj", "cp cpu ms/traj", "pg cpu", "node cpu", "WAL kB/traj",
            "WAL MB/s", "writes/tx", "machine busy", "expired", "load")  # fmt: skip
    if header:
        print(" | ".join(cols))
    print(
        " | ".join(
            [
                str(row["nodes"]), str(row["tasks"]), str(row["loops"]),
                f"{row['traj_per_h_sim']:,.0f}", f"{row['traj_per_s_real']:.2f}",
                f"{row['efficiency']:.1%}", f"{row['efficiency_mix']:.1%}",
                f"{row['claim_p50_ms']}/{row['claim_p99_ms']}",
                f"{row['claims_per_traj']:.2f}", f"{row['cp_wall_ms_per_traj']:.1f}",
                f"{row['cp_cpu_ms_per_traj']:.1f}", f"{row['pg_cpu_ms_per_traj']:.1f}",
                f"{row['node_cpu_ms_per_traj']:.1f}", f"{row['wal_kb_per_traj']:.0f}",
                f"{row['wal_mb_per_s']:.2f}",
                f"{row['writes_per_transaction'] or 0:.2f}", f"{row['machine_busy']:.0%}",
                f"{row['expired_frac']:.1%}",
                "/".join(f"{x:g}" for x in row["load"]),
            ]
        ),
        flush=True,
    )  # fmt: skip


if __name__ == "__main__":
    main()
