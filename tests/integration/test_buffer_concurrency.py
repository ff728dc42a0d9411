"""Many concurrent claimers, in threads and in processes, on a real PostgreSQL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from rollcall.orchestrator.db.engine import Database, open_database
from tests.integration.buffer_helpers import add_tasks, finish, make_buffer, rows, scalar


def test_concurrent_claims_never_exceed_max_inflight(
    db_url: str, db: Database, engine: sa.Engine
) -> None:
    add_tasks(db, {"name": "a", "max_inflight": 5, "max_staleness": 8, "group_size": 1})
    make_buffer(db, batch_groups=4).seed()  # 36 queued episodes
    barrier = threading.Barrier(16)
    results: list[Any] = []
    lock = threading.Lock()

    def claimer(i: int) -> None:
        dbi = open_database(db_url, pool_size=1)
        buf = make_buffer(dbi, batch_groups=4)
        w = buf.register_worker(f"r{i}")
        barrier.wait()
        c = buf.claim(w.id)
        with lock:
            results.append(c)
        dbi.dispose()

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    claimed = [c for c in results if c is not None]
    assert len(claimed) == 5
    assert len({c.lease.episode_id for c in claimed}) == 5
    assert scalar(engine, "SELECT count(*) FROM episodes WHERE status = 'leased'") == 5


def test_threads_claim_every_episode_exactly_once(
    db_url: str, db: Database, engine: sa.Engine
) -> None:
    add_tasks(
        db,
        {"name": "a", "weight": 2, "max_inflight": 3, "max_staleness": 6, "group_size": 2},
        {"name": "b", "weight": 1, "max_inflight": 2, "max_staleness": 6, "group_size": 2},
    )
    make_buffer(db, batch_groups=6).seed()
    seeded = scalar(engine, "SELECT count(*) FROM episodes")
    claimed: list[int] = []
    lock = threading.Lock()
    max_leased: Counter[int] = Counter()
    stop = threading.Event()

    def monitor() -> None:
        while not stop.is_set():
            for task, n in rows(
                engine, "SELECT task_id, count(*) FROM episodes WHERE status = 'leased' GROUP BY 1"
            ):
                max_leased[task] = max(max_leased[task], n)

    def worker(i: int) -> None:
        dbi = open_database(db_url, pool_size=1)
        buf = make_buffer(dbi, batch_groups=6)
        w = buf.register_worker(f"r{i}")
        while True:
            c = buf.claim(w.id)
            if c is None:
                break
            with lock:
                claimed.append(c.lease.episode_id)
            finish(buf, c, version=0)
        dbi.dispose()

    mon = threading.Thread(target=monitor)
    mon.start()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    mon.join()
    assert sorted(claimed) == sorted(set(claimed))  # no episode claimed twice
    assert len(claimed) == seeded
    assert scalar(engine, "SELECT count(*) FROM episodes WHERE status <> 'done'") == 0
    assert scalar(engine, "SELECT count(*) FROM trajectories WHERE status = 'ready'") == 2 * seeded
    assert max_leased[1] <= 3 and max_leased[2] <= 2


CLAIMER = textwrap.dedent(
    """
    import json, os, sys
    from rollcall.orchestrator.db.engine import open_database
    from rollcall.orchestrator.buffer.rollout import RolloutBuffer
    from rollcall.orchestrator.config import BufferConfig
    from tests.integration.buffer_helpers import finish
    db = open_database(os.environ["URL"], pool_size=1)
    buf = RolloutBuffer(db, 1, BufferConfig(batch_groups=8))
    w = buf.register_worker("proc-" + sys.argv[1])
    got = []
    while True:
        c = buf.claim(w.id)
        if c is None:
            break
        got.append(c.lease.episode_id)
        finish(buf, c, version=0)
    print(json.dumps(got))
    """
)


def test_processes_claim_every_episode_exactly_once(
    db_url: str, db: Database, engine: sa.Engine
) -> None:
    add_tasks(
        db,
        {"name": "a", "max_inflight": 4, "max_staleness": 4, "group_size": 1},
        {"name": "b", "max_inflight": 4, "max_staleness": 4, "group_size": 1},
    )
    make_buffer(db, batch_groups=8).seed()
    seeded = scalar(engine, "SELECT count(*) FROM episodes")
    env = {**os.environ, "URL": db_url, "PYTHONPATH": str(Path.cwd())}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CLAIMER, str(i)], env=env, stdout=subprocess.PIPE, text=True
        )
        for i in range(4)
    ]
    claimed: list[int] = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        claimed += json.loads(out)
    assert len(claimed) == seeded == len(set(claimed))
    states = dict(rows(engine, "SELECT status::text, count(*) FROM episodes GROUP BY 1"))
    assert states == {"done": seeded}
