"""Benchmark of the durable buffer on the embedded PostgreSQL.

Measures, on a fresh database in a temporary ROLLCALL_HOME:

1. commit throughput: W writer processes claim groups and commit 4K-token trajectories (token
   ids, loss mask, behaviour log-probs), one statement per trajectory, as rollout nodes do;
2. episode-claim latency p50/p99 with C concurrent claimers, each working on its episode for
   an exponentially distributed time (``--think-ms``) before its next claim, as rollout nodes
   do: as threads of one process, then spread over 8 processes (on a 2-CPU machine those client
   processes compete with PostgreSQL for the CPUs, which shows in the tail); then the same
   claimers with no work between claims, which measures the saturated claim rate (latency
   there is queueing: claimers / rate);
3. trainer batch claim and step commit latency for batches of B groups.

Usage: python ops/bench/buffer.py [--writers 8] [--claimers 64] [--tokens 4096] [--quick]
Prints a table, then (last line) one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

from rollcall.orchestrator.buffer.rollout import RolloutBuffer
from rollcall.orchestrator.buffer.trainer import TrainerBuffer
from rollcall.orchestrator.config import BufferConfig
from rollcall.orchestrator.db import migrate
from rollcall.orchestrator.db.embedded import MIGRATOR, EmbeddedPostgres
from rollcall.orchestrator.db.engine import open_database
from rollcall.orchestrator.domain import TrajectoryPayload
from rollcall.orchestrator.services.tasks import register_task

GROUP = 8
TASKS = ("math", "search", "game", "code")


def make_payload(tokens: int, seed: int) -> TrajectoryPayload:
    rng = np.random.default_rng(seed)
    turns = 10
    offsets = [i * tokens // turns for i in range(turns)]
    mask = np.zeros(tokens, dtype=np.uint8)
    for i, start in enumerate(offsets):
        end = offsets[i + 1] if i + 1 < turns else tokens
        mask[start + (end - start) // 3 : end] = 1  # observation tokens then generated tokens
    return TrajectoryPayload.build(
        rng.integers(0, 151_000, tokens),
        mask,
        np.where(mask == 1, -rng.random(tokens), 0.0),
        turn_offsets=offsets,
        turn_versions=[0] * turns,
        prompt_tokens=offsets[1] // 3,
        env_state={"turn": turns, "scratch": "x" * 64},
    )


def setup(url: str, episodes_per_task: int) -> None:
    db = open_database(url, verify_schema=False)
    with db.engine.connect() as conn:
        migrate.upgrade(conn)
        conn.commit()
        if os.environ.get("DROPFK"):
            conn.exec_driver_sql(
                "ALTER TABLE trajectories DROP CONSTRAINT fk_trajectories_task_id_tasks"
            )
            conn.commit()
    with db.transaction() as tx:
        for name in TASKS:
            register_task(
                tx,
                job_name="default",
                name=name,
                plugin="echo",
                actor="bench",
                max_inflight=100_000,
                max_staleness=1000,
                spec_data={"group_size": GROUP},
            )
    with db.transaction() as tx:
        for task_id in range(1, len(TASKS) + 1):
            tx.episodes.add_episodes(
                job_id=1,
                task_id=task_id,
                first_index=0,
                prompts=[{"i": i} for i in range(episodes_per_task)],
                group_size=GROUP,
            )
    db.dispose()


def writer(url: str, idx: int, tokens: int, groups: int, ready: Any, go: Any, out: Any) -> None:
    db = open_database(url, pool_size=1)
    buf = RolloutBuffer(db, 1, BufferConfig(lease_s=600))
    w = buf.register_worker(f"writer-{idx}")
    payloads = [make_payload(tokens, idx * 100 + i) for i in range(GROUP)]
    ready.release()
    go.wait()
    committed = 0
    commit_s = 0.0
    for _ in range(groups):
        c = buf.claim(w.id)
        if c is None:
            break
        t0 = time.perf_counter()
        for i in range(GROUP):
            buf.commit(c.lease, i, payloads[i], float(i % 2))
        commit_s += time.perf_counter() - t0
        committed += GROUP
    db.dispose()
    out.put((committed, commit_s))


def commit_phase(url: str, writers: int, tokens: int, groups: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    q, ready, go = ctx.Queue(), ctx.Semaphore(0), ctx.Event()
    procs = [
        ctx.Process(target=writer, args=(url, i, tokens, groups, ready, go, q))
        for i in range(writers)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.acquire()  # every writer is connected and has its payloads: start the clock
    t0 = time.perf_counter()
    go.set()
    results = [q.get() for _ in procs]
    wall = time.perf_counter() - t0  # before the processes' exit, which is not commit work
    for p in procs:
        p.join()
    n = sum(r[0] for r in results)
    busy = sum(r[1] for r in results)
    return {
        "trajectories": n,
        "wall_s": wall,
        "per_s": n / wall,
        "commit_per_s": n / (busy / writers),
    }


def claimer_proc(
    url: str,
    idx: int,
    threads: int,
    claims: int,
    think_ms: float,
    ready: Any,
    go: Any,
    out: Any,
) -> None:
    lat: list[float] = []
    lock = threading.Lock()

    def all_ready() -> None:  # the last thread to arrive reports readiness, then waits for go
        ready.release()
        go.wait()

    barrier = threading.Barrier(threads, action=all_ready)

    def run(t: int) -> None:
        db = open_database(url, pool_size=1)
        buf = RolloutBuffer(db, 1, BufferConfig(lease_s=600))
        w = buf.register_worker(f"claimer-{idx}-{t}")
        mine = []
        rng = random.Random(idx * 1000 + t)
        barrier.wait()
        for _ in range(claims):
            if think_ms > 0:  # the claimer rolls out its episode before claiming again
                time.sleep(rng.expovariate(1000.0 / think_ms))
            t0 = time.perf_counter()
            c = buf.claim(w.id)
            mine.append(time.perf_counter() - t0)
            assert c is not None
        with lock:
            lat.extend(mine)
        db.dispose()

    ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out.put(lat)


def claim_phase(
    url: str, claimers: int, claims: int, think_ms: float, processes: int = 8
) -> dict[str, float]:
    procs_n = min(processes, claimers)
    threads = claimers // procs_n
    ctx = mp.get_context("spawn")
    q, ready, go = ctx.Queue(), ctx.Semaphore(0), ctx.Event()
    procs = [
        ctx.Process(target=claimer_proc, args=(url, i, threads, claims, think_ms, ready, go, q))
        for i in range(procs_n)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.acquire()
    t0 = time.perf_counter()
    go.set()
    lat: list[float] = []
    for _ in procs:
        lat += q.get()
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    lat.sort()
    return {
        "claims": len(lat),
        "claimers": procs_n * threads,
        "p50_ms": 1000 * lat[len(lat) // 2],
        "p99_ms": 1000 * lat[int(len(lat) * 0.99)],
        "max_ms": 1000 * lat[-1],
        "per_s": len(lat) / wall,
    }


def trainer_phase(url: str, batch_groups: int, steps: int) -> dict[str, float]:
    db = open_database(url)
    buf = TrainerBuffer(db, 1, BufferConfig(batch_groups=batch_groups))
    claim_ms, commit_ms, trajs = [], [], 0
    for step in range(steps):
        t0 = time.perf_counter()
        batch = buf.claim_batch(step)
        t1 = time.perf_counter()
        assert batch.groups, "no data for the trainer"
        buf.commit_step(step, checkpoint_uri=f"file:///bench/{step}", metrics={"loss": 0.0})
        t2 = time.perf_counter()
        claim_ms.append(1000 * (t1 - t0))
        commit_ms.append(1000 * (t2 - t1))
        trajs += batch.num_trajectories
    db.dispose()
    return {
        "batch_groups": batch_groups,
        "trajectories_per_batch": trajs / steps,
        "claim_p50_ms": statistics.median(claim_ms),
        "commit_p50_ms": statistics.median(commit_ms),
        "claim_max_ms": max(claim_ms),
        "commit_max_ms": max(commit_ms),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--claimers", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--groups-per-writer", type=int, default=40)
    ap.add_argument("--claims-per-claimer", type=int, default=40)
    ap.add_argument(
        "--think-ms",
        type=float,
        default=250.0,
        help="mean time a claimer works on an episode before its next claim (exponential)",
    )
    ap.add_argument("--batch-groups", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.groups_per_writer, args.claims_per_claimer, args.claimers = 4, 5, 16
        args.batch_groups = 8

    home = Path(tempfile.mkdtemp(prefix="rc-bench-", dir="/tmp"))
    home.chmod(0o711)  # as root, the server's user passes through it
    server = EmbeddedPostgres(home)
    try:
        url = server.ensure_running()
        per_task = (
            args.writers * args.groups_per_writer + 3 * args.claimers * args.claims_per_claimer
        ) // len(TASKS) + 64
        setup(server.url(role=MIGRATOR), per_task)  # migrations: the migrator's
        print(
            f"# buffer benchmark: {os.cpu_count()} CPUs, embedded PostgreSQL, "
            f"{args.tokens}-token trajectories",
            flush=True,
        )
        single = commit_phase(url, args.writers, args.tokens, args.groups_per_writer)
        groups_done = single["trajectories"] // GROUP
        trainer = trainer_phase(
            url, args.batch_groups, steps=max(1, min(5, groups_done // args.batch_groups))
        )
        claims = claim_phase(
            url, args.claimers, args.claims_per_claimer, args.think_ms, processes=1
        )
        spread = claim_phase(
            url, args.claimers, args.claims_per_claimer, args.think_ms, processes=8
        )
        saturated = claim_phase(url, args.claimers, args.claims_per_claimer, 0.0, processes=1)
    finally:
        server.stop()
        shutil.rmtree(home, ignore_errors=True)

    rows = [
        (
            "commit, 1 trajectory per transaction",
            f"{single['per_s']:.0f} traj/s",
            f"{args.writers} writers, {single['trajectories']} trajectories",
        ),
        (
            "episode claim p50 / p99",
            f"{claims['p50_ms']:.1f} / {claims['p99_ms']:.1f} ms",
            f"{claims['claimers']} concurrent claimers (threads of 1 process), {args.think_ms:g} "
            f"ms mean work between claims, {claims['per_s']:.0f} claims/s",
        ),
        (
            "episode claim p50 / p99, 8 processes",
            f"{spread['p50_ms']:.1f} / {spread['p99_ms']:.1f} ms",
            f"the same {spread['claimers']} claimers in 8 processes on {os.cpu_count()} CPUs "
            "(client processes compete for the CPUs)",
        ),
        (
            "episode claim, saturated",
            f"{saturated['per_s']:.0f} claims/s",
            f"{saturated['claimers']} claimers with no work between claims: p50 "
            f"{saturated['p50_ms']:.0f} ms, p99 {saturated['p99_ms']:.0f} ms (queueing)",
        ),
        (
            "trainer batch claim p50",
            f"{trainer['claim_p50_ms']:.0f} ms",
            f"{args.batch_groups} groups = {trainer['trajectories_per_batch']:.0f} trajectories",
        ),
        (
            "trainer step commit p50",
            f"{trainer['commit_p50_ms']:.0f} ms",
            "consume + train_steps row + version bump",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>18}  {note}")
    print(
        json.dumps(
            {
                "bench": "buffer",
                "tokens": args.tokens,
                "writers": args.writers,
                "commit_traj_per_s": round(single["per_s"], 1),
                "claimers": claims["claimers"],
                "claim_p50_ms": round(claims["p50_ms"], 2),
                "claim_p99_ms": round(claims["p99_ms"], 2),
                "claims_per_s": round(claims["per_s"], 1),
                "think_ms": args.think_ms,
                "claim_8proc_p50_ms": round(spread["p50_ms"], 2),
                "claim_8proc_p99_ms": round(spread["p99_ms"], 2),
                "saturated_claims_per_s": round(saturated["per_s"], 1),
                "saturated_claim_p99_ms": round(saturated["p99_ms"], 2),
                "batch_groups": args.batch_groups,
                "batch_claim_p50_ms": round(trainer["claim_p50_ms"], 1),
                "step_commit_p50_ms": round(trainer["commit_p50_ms"], 1),
            }
        )
    )


if __name__ == "__main__":
    main()
