"""Two registrations of one name at once: exactly one succeeds, the other writes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import sqlalchemy as sa

from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.services.tasks import register_task


def _rollcall(db_url: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "ROLLCALL_DATABASE_URL": db_url}
    return subprocess.Popen(
        [sys.executable, "-m", "rollcall.orchestrator.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _state(engine: sa.Engine) -> tuple[int, int, int]:
    with engine.connect() as conn:
        tasks = conn.scalar(sa.text("SELECT count(*) FROM tasks"))
        parts = conn.scalar(
            sa.text("SELECT count(*) FROM pg_class WHERE relname ~ '^trajectories_t[0-9]+$'")
        )
        events = conn.scalar(sa.text("SELECT count(*) FROM events WHERE kind = 'task.registered'"))
    return int(tasks or 0), int(parts or 0), int(events or 0)


def test_interleaved_registration_loser_is_refused(
    db: Database, db_url: str, engine: sa.Engine
) -> None:
    """Deterministic interleaving: A has inserted but not committed when B registers."""
    with db.transaction() as tx:
        register_task(tx, job_name="default", name="dup", plugin="echo", actor="test:a")
        proc = _rollcall(db_url, "task", "register", "dup", "--plugin", "echo")
        # B blocks on the unique index until A commits; give it time to get there.
        deadline = time.monotonic() + 30
        waiting = False
        while time.monotonic() < deadline and not waiting:
            with engine.connect() as conn:
                waiting = bool(
                    conn.scalar(
                        sa.text(
                            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'rollcall' "
                            "AND wait_event_type = 'Lock'"
                        )
                    )
                )
            time.sleep(0.05)
        assert waiting, "the second registration never reached the lock"
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "a task named 'dup' already exists" in err
    assert _state(engine) == (1, 1, 1)


def test_concurrent_registrations_exactly_one_wins(db_url: str, engine: sa.Engine) -> None:
    procs = [_rollcall(db_url, "task", "register", "race", "--plugin", "echo") for _ in range(6)]
    results = [(p.wait(timeout=120), p.communicate()) for p in procs]
    codes = [code for code, _ in results]
    assert codes.count(0) == 1, results
    for code, (_out, err) in results:
        if code != 0:
            assert "already exists" in err, err
    assert _state(engine) == (1, 1, 1)
