"""A rollout node stopped inside a transaction (SIGSTOP, a frozen machine) keeps its row locks
for as long as its session lives, and the dead-worker sweep skips locked rows (``FOR UPDATE
SKIP LOCKED``, so that it never waits on a busy node). Unbounded, such a node was never
declared dead: the randomized chaos run failed twice this way (a SIGSTOP that landed inside a
heartbeat's transaction was neither detected nor recovered within the drill's 180 s). The
node's sessions end a transaction left idle longer than its ``db_idle_tx_timeout_s`` (the
heartbeat timeout), and the sweep then declares it dead.

The node here is a real process with the node's own database factory, stopped by a real
SIGSTOP between its heartbeat's UPDATE and its commit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import OperationalError

from rollcall.orchestrator import procfs
from rollcall.orchestrator.buffer.control import DeadWorker
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.services.drills import Drills
from tests.integration.buffer_helpers import make_buffer
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(180)

HEARTBEAT_TIMEOUT_S = 4.0  # control_plane.heartbeat_timeout_s, and the node's idle bound

# the node's process: its database as the node opens it, a heartbeat's UPDATE, then a hang
# before the commit
HANG_IN_HEARTBEAT = """
import os, signal, sys
from rollcall.workers.rollout.node import NodeConfig, node_database
url, worker_id, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
config = NodeConfig(name="hung", model_dir="-", db_idle_tx_timeout_s=timeout_s)
db = node_database(url, config, connections=1)
with db.transaction() as tx:
    assert tx.workers.heartbeat(worker_id)
    print("in the transaction", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
"""


def _stopped(pid: int) -> bool:
    proc = procfs.stat(pid)
    assert proc is not None and not proc.zombie, "the hung node exited"
    return proc.state == "T"


@pytest.fixture
def hung_node(db: Database, db_url: str) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    node = make_buffer(db).register_worker("hung")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", HANG_IN_HEARTBEAT, db_url, str(node.id), str(HEARTBEAT_TIMEOUT_S)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "in the transaction"
        wait_for("the node's process stopped", lambda: _stopped(proc.pid), timeout_s=30)
        yield node.id, proc
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=30)


def test_a_node_stopped_inside_a_transaction_is_declared_dead(
    db: Database, engine: sa.Engine, hung_node: tuple[int, subprocess.Popen[str]]
) -> None:
    worker_id, _ = hung_node
    # the hazard is real: its row is locked by the stopped process's open transaction
    with pytest.raises(OperationalError, match="could not obtain lock"), engine.connect() as c:
        c.execute(
            sa.text("SELECT 1 FROM workers WHERE id = :w FOR UPDATE NOWAIT"), {"w": worker_id}
        )
    # what a drill that waited in vain reports of it (the lock, the idle session)
    note = Drills(db, "default")._not_declared_dead(worker_id, "hung")
    assert "its row LOCKED by another session" in note, note
    assert "0 sessions idle in a transaction" not in note, note
    control = make_buffer(db)
    dead: list[DeadWorker] = []

    def swept() -> bool:
        dead.extend(control.sweep_dead_workers(HEARTBEAT_TIMEOUT_S, 600.0))
        return bool(dead)

    # its beats stop at the hang, and its transaction is ended by the server after the same
    # timeout: a few sweeps after that (with slack for a busy machine), not never
    wait_for("the stopped node declared dead", swept, timeout_s=10 * HEARTBEAT_TIMEOUT_S)
    assert [(d.worker_id, d.name) for d in dead] == [(worker_id, "hung")]
    assert dead[0].reason.startswith("no heartbeat for ")
    with db.transaction() as tx:
        after = tx.workers.diagnose(worker_id)
    assert after is not None and after["status"] == "dead" and not after["row_locked"]


def test_a_job_bounds_its_nodes_idle_transactions_by_the_heartbeat_timeout(
    db: Database, tmp_path: Path
) -> None:
    from tests.chaos.test_faults import _config, _driver

    cfg = _config(tmp_path, tmp_path, steps=1)
    driver = _driver(cfg, db, tmp_path, tmp_path)
    timeout_s = cfg.control_plane.heartbeat_timeout_s
    assert [driver.node_config(i).db_idle_tx_timeout_s for i in range(2)] == [timeout_s] * 2
