"""Bytes written per trajectory by per-turn checkpoints, against turns and tokens.

On a fresh embedded PostgreSQL (a temporary ROLLCALL_HOME), one writer plays (after one
warm-up trajectory per cell, not counted) trajectories of
T tokens in K equal turns (each turn: a third observation tokens, two thirds generated, as
``ops/bench/buffer.py``), checkpointing after every turn and committing after the last, as a
rollout node does. For each (K, T) it reports, per trajectory:

- WAL bytes (``pg_current_wal_lsn()`` before and after, all of the writer's statements);
- the heap and TOAST bytes the trajectory's payload occupies at the end (what is kept);
- WAL / payload: 1-2 when each checkpoint writes only its new turn, about K/2 when every
  checkpoint rewrites the whole trajectory.

Only the public ``Buffer`` API is used (claim, checkpoint, commit), so the same file measures
an older rollcall for a before/after table: ``git worktree add /tmp/old <rev>``, copy this file
there and run it with that tree's Python path.

Usage: python ops/bench/turn_writes.py [--turns 1 4 16 64] [--tokens 1024 4096 16384 32768]
       [--trajectories 3] [--quick]
Prints a table, then (last line) one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import sqlalchemy as sa

from orchestrator.buffer.service import Buffer
from orchestrator.config import BufferConfig
from orchestrator.db import migrate
from orchestrator.db.embedded import EmbeddedPostgres
from orchestrator.db.engine import open_database
from orchestrator.domain import TrajectoryPayload
from orchestrator.services.tasks import register_task


def trajectory(tokens: int, turns: int, seed: int) -> list[TrajectoryPayload]:
    """The payload after each turn of one trajectory."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 151_000, tokens)
    offsets = [i * tokens // turns for i in range(turns)]
    mask = np.zeros(tokens, dtype=np.uint8)
    for i, start in enumerate(offsets):
        end = offsets[i + 1] if i + 1 < turns else tokens
        mask[start + (end - start) // 3 : end] = 1
    logprobs = np.where(mask == 1, -rng.random(tokens), 0.0)
    out = []
    for k in range(1, turns + 1):
        n = offsets[k] if k < turns else tokens
        out.append(
            TrajectoryPayload.build(
                ids[:n],
                mask[:n],
                logprobs[:n],
                turn_offsets=offsets[:k],
                turn_versions=[0] * k,
                prompt_tokens=offsets[1] // 3 if turns > 1 else tokens // 3,
                env_state={"turn": k},
            )
        )
    return out


def payload_relations(conn: sa.Connection) -> list[str]:
    """The tables that hold payload bytes in this schema (before or after append-only turns)."""
    names = conn.execute(
        sa.text(
            "SELECT relname FROM pg_class WHERE relkind = 'r' AND "
            "(relname ~ '^trajectories_t[0-9]+$' OR relname = 'trajectory_segments')"
        )
    ).scalars()
    return list(names)


def stored_bytes(conn: sa.Connection) -> int:
    total = 0
    for name in payload_relations(conn):
        total += int(conn.execute(sa.text(f"SELECT pg_table_size('{name}')")).scalar_one())
    return total


def play(buf: Buffer, worker_id: int, turns: list[TrajectoryPayload]) -> None:
    c = buf.claim(worker_id)  # the earlier cells' tasks have nothing queued
    assert c is not None
    for p in turns[:-1]:
        buf.checkpoint(c.lease, 0, p)
    buf.commit(c.lease, 0, turns[-1], 1.0)


def measure(url: str, turns: int, tokens: int, n: int, seed: int) -> dict[str, Any]:
    db = open_database(url, pool_size=2)
    with db.transaction() as tx:
        task = register_task(
            tx,
            job_name="default",
            name=f"k{turns}-t{tokens}",
            plugin="echo",
            actor="bench",
            max_inflight=1_000,
            max_staleness=1_000,
            spec_data={"group_size": 1},
        )
        tx.episodes.add_episodes(
            job_id=1,
            task_id=task.id,
            first_index=0,
            prompts=[{"i": i} for i in range(n + 1)],
            group_size=1,
        )
    buf = Buffer(db, 1, BufferConfig(lease_s=600))
    w = buf.register_worker(f"bench-{turns}-{tokens}")
    plays = [trajectory(tokens, turns, seed + i) for i in range(n + 1)]
    play(buf, w.id, plays.pop())  # warm-up: the new partition's first pages, caches
    with db.engine.connect() as conn:
        size0 = stored_bytes(conn)
        lsn0 = conn.execute(sa.text("SELECT pg_current_wal_lsn()")).scalar_one()
        conn.commit()
    t0 = time.perf_counter()
    for turns_played in plays:
        play(buf, w.id, turns_played)
    wall = time.perf_counter() - t0
    with db.engine.connect() as conn:
        wal = int(
            conn.execute(
                sa.text("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), :l)"), {"l": lsn0}
            ).scalar_one()
        )
        size = stored_bytes(conn) - size0
        conn.commit()
    db.dispose()
    payload = tokens * 9  # int32 ids + uint8 mask + float32 log-probs
    return {
        "turns": turns,
        "tokens": tokens,
        "payload_bytes": payload,
        "wal_bytes_per_traj": wal / n,
        "stored_bytes_per_traj": size / n,
        "wal_over_payload": wal / n / payload,
        "ms_per_checkpoint": 1e3 * wall / (n * turns),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--turns", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--trajectories", type=int, default=3, help="per (turns, tokens) cell")
    ap.add_argument("--quick", action="store_true", help="two cells, for a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.turns, args.tokens, args.trajectories = [1, 8], [2048], 1
    home = Path(tempfile.mkdtemp(prefix="rc-bench-", dir="/tmp"))
    server = EmbeddedPostgres(home)
    results = []
    try:
        url = server.ensure_running()
        db = open_database(url, verify_schema=False)
        with db.engine.connect() as conn:
            migrate.upgrade(conn)
            conn.commit()
        db.dispose()
        print(
            f"# per-turn checkpoint writes: {os.cpu_count()} CPUs, embedded PostgreSQL, "
            f"{args.trajectories} trajectories per cell",
            flush=True,
        )
        print(
            f"{'turns':>5} {'tokens':>6} {'payload':>9} {'WAL/traj':>10} {'stored':>9} "
            f"{'WAL/payload':>11} {'ms/ckpt':>8}"
        )
        seed = 0
        for tokens in args.tokens:
            for turns in args.turns:
                r = measure(url, turns, tokens, args.trajectories, seed)
                seed += args.trajectories
                results.append(r)
                print(
                    f"{turns:>5} {tokens:>6} {r['payload_bytes'] / 1e3:>7.0f}kB "
                    f"{r['wal_bytes_per_traj'] / 1e3:>8.0f}kB "
                    f"{r['stored_bytes_per_traj'] / 1e3:>7.0f}kB "
                    f"{r['wal_over_payload']:>11.2f} {r['ms_per_checkpoint']:>8.2f}",
                    flush=True,
                )
    finally:
        server.stop()
        shutil.rmtree(home, ignore_errors=True)
    print(json.dumps({"turn_writes": results}))


if __name__ == "__main__":
    main()
