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

Then an agent episode (``workers/episode``): C calls through ``ctx``, alternately a chat call
(64 generated tokens after the previous tool's observation, about a token per 4 bytes) and a
tool call whose result is R bytes of text, checkpointed after every call (the journal of calls
in the trajectory's state) and committed after the last, as a rollout node does. For each C it
reports the WAL per episode two ways, on the same code: ``rewrite`` stores the whole journal
in ``env_state`` at every checkpoint (what every agent checkpoint did before migration 0008;
a state without the writer's ``journal_stored`` mark still takes that path), ``append`` with
the mark, as ``AgentContext`` writes it now (each checkpoint stores only its new call:
``agent_journal`` rows). Doubling C doubles ``append``'s WAL and about quadruples ``rewrite``'s.

Only the public ``Buffer`` API is used (claim, checkpoint, commit), so the same file measures
an older rollcall for a before/after table: ``git worktree add /tmp/old <rev>``, copy this file
there and run it with that tree's Python path.

Usage: python ops/bench/turn_writes.py [--turns 1 4 16 64] [--tokens 1024 4096 16384 32768]
       [--trajectories 3] [--agent-calls 16 32 64] [--result-bytes 4096] [--agent-only]
       [--quick]
Prints the tables, then (last line) one JSON object with the figures.
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

from rollcall.orchestrator.buffer.rollout import RolloutBuffer
from rollcall.orchestrator.config import BufferConfig
from rollcall.orchestrator.db import migrate
from rollcall.orchestrator.db.embedded import MIGRATOR, EmbeddedPostgres
from rollcall.orchestrator.db.engine import open_database
from rollcall.orchestrator.domain import JOURNAL, JOURNAL_STORED, TrajectoryPayload
from rollcall.orchestrator.services.tasks import register_task


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


def play(buf: RolloutBuffer, worker_id: int, turns: list[TrajectoryPayload]) -> None:
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
    buf = RolloutBuffer(db, 1, BufferConfig(lease_s=600))
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


def agent_episode(
    calls: int, result_bytes: int, seed: int, append: bool
) -> list[TrajectoryPayload]:
    """The payload after each call of one agent episode (chat and tool calls alternately)."""
    rng = np.random.default_rng(seed)
    ids: list[int] = list(rng.integers(0, 151_000, 256))  # the prompt
    mask: list[int] = [0] * len(ids)
    offsets: list[int] = []
    journal: list[dict[str, Any]] = []
    out = []
    observation = 0
    for k in range(calls):
        key = rng.bytes(8).hex()
        if k % 2 == 0:  # chat: the last observation's tokens, then 64 generated
            ids += list(rng.integers(0, 151_000, observation))
            mask += [0] * observation
            start = len(ids)
            offsets.append(start)
            ids += list(rng.integers(0, 151_000, 64))
            mask += [1] * 64
            journal.append({"k": "chat", "h": key, "r": {"s": start, "e": len(ids), "f": "stop",
                                                         "v": 0}})  # fmt: skip
        else:  # tool: a result of result_bytes bytes of text
            text = rng.bytes(result_bytes // 2).hex()
            journal.append({"k": "tool", "h": key, "r": {"c": text}})
            observation = result_bytes // 4
        state: dict[str, Any] = {JOURNAL: list(journal)}
        if append:  # as AgentContext marks it: the calls before this one are stored
            state[JOURNAL_STORED] = k
        logprobs = np.where(np.asarray(mask) == 1, -0.5, 0.0)
        out.append(
            TrajectoryPayload.build(
                ids,
                mask,
                logprobs,
                turn_offsets=offsets,
                turn_versions=[0] * len(offsets),
                prompt_tokens=256,
                env_state={"state": state, "answer": None, "stop_reason": ""},
            )
        )
    return out


def play_agent(buf: RolloutBuffer, worker_id: int, checkpoints: list[TrajectoryPayload]) -> None:
    c = buf.claim(worker_id)
    assert c is not None
    for p in checkpoints:  # a checkpoint after every call
        buf.checkpoint(c.lease, 0, p)
    last = checkpoints[-1]
    state = dict(last.env_state["state"])
    if JOURNAL_STORED in state:
        state[JOURNAL_STORED] = len(state[JOURNAL])
    final = TrajectoryPayload.build(
        last.token_ids, last.loss_mask, last.behaviour_logprobs, turn_offsets=last.turn_offsets,
        turn_versions=last.turn_versions, prompt_tokens=last.prompt_tokens,
        env_state={**last.env_state, "state": state}, finished=True,
    )  # fmt: skip
    buf.commit(c.lease, 0, final, 1.0)


def measure_agent(
    url: str, calls: int, result_bytes: int, n: int, seed: int, append: bool
) -> dict[str, Any]:
    db = open_database(url, pool_size=2)
    mode = "append" if append else "rewrite"
    with db.transaction() as tx:
        task = register_task(
            tx, job_name="default", name=f"agent-{calls}-{result_bytes}-{mode}", plugin="echo",
            actor="bench", max_inflight=1_000, max_staleness=1_000, spec_data={"group_size": 1},
        )  # fmt: skip
        tx.episodes.add_episodes(
            job_id=1, task_id=task.id, first_index=0, prompts=[{"i": i} for i in range(n + 1)],
            group_size=1,
        )  # fmt: skip
    buf = RolloutBuffer(db, 1, BufferConfig(lease_s=600))
    w = buf.register_worker(f"bench-agent-{calls}-{mode}")
    episodes = [agent_episode(calls, result_bytes, seed + i, append) for i in range(n + 1)]
    play_agent(buf, w.id, episodes.pop())  # warm-up
    with db.engine.connect() as conn:
        lsn0 = conn.execute(sa.text("SELECT pg_current_wal_lsn()")).scalar_one()
        conn.commit()
    t0 = time.perf_counter()
    for episode in episodes:
        play_agent(buf, w.id, episode)
    wall = time.perf_counter() - t0
    with db.engine.connect() as conn:
        wal = int(
            conn.execute(
                sa.text("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), :l)"), {"l": lsn0}
            ).scalar_one()
        )
        conn.commit()
    db.dispose()
    return {
        "calls": calls,
        "result_bytes": result_bytes,
        "mode": mode,
        "wal_bytes_per_episode": wal / n,
        "wal_bytes_per_call": wal / n / calls,
        "ms_per_checkpoint": 1e3 * wall / (n * calls),
    }


def agent_table(url: str, calls: list[int], result_bytes: int, n: int) -> list[dict[str, Any]]:
    print(
        f"# agent episodes: chat and tool calls alternately, tool results of {result_bytes} "
        f"bytes, a checkpoint per call, {n} episodes per cell",
        flush=True,
    )
    print(f"{'calls':>5} {'rewrite WAL':>12} {'append WAL':>11} {'rewrite/call':>13} "
          f"{'append/call':>12} {'ratio':>6}")  # fmt: skip
    results = []
    for i, c in enumerate(calls):
        before = measure_agent(url, c, result_bytes, n, 1_000 * (i + 1), append=False)
        after = measure_agent(url, c, result_bytes, n, 1_000 * (i + 1), append=True)
        results += [before, after]
        b, a = before["wal_bytes_per_episode"], after["wal_bytes_per_episode"]
        print(
            f"{c:>5} {b / 1e6:>10.2f}MB {a / 1e6:>9.2f}MB {b / c / 1e3:>11.1f}kB "
            f"{a / c / 1e3:>10.1f}kB {b / a:>6.1f}",
            flush=True,
        )
    return results


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--turns", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--trajectories", type=int, default=3, help="per (turns, tokens) cell")
    ap.add_argument("--agent-calls", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--result-bytes", type=int, default=4096, help="each tool call's result")
    ap.add_argument("--episodes", type=int, default=2, help="agent episodes per cell")
    ap.add_argument("--agent-only", action="store_true", help="only the agent episodes' table")
    ap.add_argument("--quick", action="store_true", help="a few cells, for a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.turns, args.tokens, args.trajectories = [1, 8], [2048], 1
        args.agent_calls, args.episodes = [8, 16], 1
    if args.agent_only:
        args.turns, args.tokens = [], []
    home = Path(tempfile.mkdtemp(prefix="rc-bench-", dir="/tmp"))
    home.chmod(0o711)  # as root, the server's user passes through it
    server = EmbeddedPostgres(home)
    results = []
    agent: list[dict[str, Any]] = []
    try:
        url = server.ensure_running()
        db = open_database(server.url(role=MIGRATOR), verify_schema=False)  # migrations
        with db.engine.connect() as conn:
            migrate.upgrade(conn)
            conn.commit()
        db.dispose()
        if args.turns and args.tokens:
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
        agent = agent_table(url, args.agent_calls, args.result_bytes, args.episodes)
    finally:
        server.stop()
        shutil.rmtree(home, ignore_errors=True)
    print(json.dumps({"turn_writes": results, "agent_journal": agent}))


if __name__ == "__main__":
    main()
