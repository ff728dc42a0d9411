"""A rollout node's database connections are bounded by ``rollout.db_connections``, not by its
agent loops: the pipeline benchmark's 1,024 loops (16 nodes x 64) ran a 300-connection
PostgreSQL out of connections when each node's pool grew with its loops. Calls beyond the
bound wait for a connection; the heartbeat has a connection of its own."""

from __future__ import annotations

import threading

import sqlalchemy as sa

from rollcall.workers.rollout.node import NodeConfig, node_database


def test_a_node_pool_holds_db_connections_and_its_callers_wait(db_url: str) -> None:
    cfg = NodeConfig(name="rollout-0", model_dir="-", concurrency=16, db_connections=3)
    db = node_database(db_url, cfg)
    pids: list[int] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            with db.transaction() as tx:
                pid = tx.session.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
                tx.session.execute(sa.text("SELECT pg_sleep(0.2)"))
            pids.append(int(pid))
        except BaseException as e:
            errors.append(e)

    try:
        threads = [threading.Thread(target=call) for _ in range(cfg.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors and len(pids) == cfg.concurrency  # every caller served, in turn
        assert len(set(pids)) <= 3
    finally:
        db.dispose()
