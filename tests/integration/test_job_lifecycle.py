"""One driver per job, and the job's lifecycle, without Ray: the drivers here run their real
``setup()`` and ``close()`` (the database side: job row, lock, tasks, recovery of a previous
run) with Ray, the trainer, the nodes and the scheduler left out. The first driver of a test
may be another process, which is then SIGKILLed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from rich.console import Console

from rollcall.orchestrator.buffer.control import ControlPlaneBuffer
from rollcall.orchestrator.buffer.rollout import RolloutBuffer
from rollcall.orchestrator.config import RollcallConfig
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.errors import ConflictError
from rollcall.orchestrator.runner.driver import JobDriver
from tests.integration.buffer_helpers import add_tasks, drain_queue, make_buffer, rows, scalar
from tests.support.waiting import wait_for

REFUSED = r"job 'life' is already running under another driver .*rollcall job stop life"
# What a refused driver must not touch (its refusal itself is an event).
TABLES = ("jobs", "tasks", "workers", "episodes", "train_steps")


def config(tmp: Path) -> RollcallConfig:
    return RollcallConfig.model_validate(
        {
            "job": {"name": "life"},
            "model": {"path": str(tmp)},
            "buffer": {"batch_groups": 1},
            "run": {"dir": str(tmp / "run"), "total_steps": 5},
            "tasks": [
                {"name": "calc", "plugin": "calculator", "spec": {"group_size": 2}},
            ],
        }
    )


def without_ray(driver: JobDriver) -> JobDriver:
    """The driver's database side only: no Ray, trainer, nodes, evaluator, scheduler, metrics."""
    for name in (
        "_start_ray",
        "_start_trainer",
        "_start_nodes",
        "_start_evaluator",
        "_start_scheduler",
        "_start_metrics",
    ):
        setattr(driver, name, lambda: None)
    return driver


def make_driver(cfg: RollcallConfig, db: Database, tmp: Path, *, resume: bool = False) -> JobDriver:
    return without_ray(
        JobDriver(
            cfg, db, model_dir=tmp, home=tmp, resume=resume, console=Console(file=None), live=False
        )
    )


# A first driver in a process of its own: set up, then wait to be killed.
CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from rollcall.orchestrator.db.engine import open_database
    from tests.integration.test_job_lifecycle import config, make_driver

    url, tmp = sys.argv[1], Path(sys.argv[2])
    db = open_database(url)
    driver = make_driver(config(tmp), db, tmp)
    driver.setup()
    print("held", flush=True)
    time.sleep(600)
    """
)


def table_rows(engine: sa.Engine) -> dict[str, list[tuple[Any, ...]]]:
    with engine.connect() as conn:
        return {
            t: [tuple(r) for r in conn.execute(sa.text(f"SELECT * FROM {t} ORDER BY 1"))]
            for t in TABLES
        }


def test_second_driver_is_refused_until_the_first_driver_dies(
    db: Database, db_url: str, engine: sa.Engine, tmp_path: Path
) -> None:
    cfg = config(tmp_path)
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    first = subprocess.Popen(
        [sys.executable, "-c", CHILD, db_url, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=repo,
        env=env,
    )
    try:
        assert first.stdout is not None
        lines = iter(first.stdout.readline, "")
        assert any(line.strip() == "held" for line in lines), "the first driver did not set up"
        # the first driver's work: a live rollout node holding an episode
        job_id = scalar(engine, "SELECT id FROM jobs WHERE name = 'life'")
        ControlPlaneBuffer(db, job_id, cfg.buffer).seed()
        buf = RolloutBuffer(db, job_id, cfg.buffer)
        node = buf.register_worker("rollout-0")
        assert buf.claim(node.id) is not None
        before = table_rows(engine)

        second = make_driver(cfg, db, tmp_path, resume=True)
        try:
            with pytest.raises(ConflictError, match=REFUSED):
                second.setup()
        finally:
            second.close()
        assert table_rows(engine) == before  # the first driver's node is alive, its lease held
        refused = rows(engine, "SELECT message FROM events WHERE kind = 'job.driver_refused'")
        assert len(refused) == 1 and f"pid {first.pid}" in refused[0][0]
        # PostgreSQL's backend of the first driver's lock, stopped: once the driver is killed,
        # its lock stays held until the backend reads the end of its socket, as on a busy
        # machine (seen in CI: a driver restarted at once was refused by a dead one's lock)
        backend = int(
            scalar(
                engine,
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
                "AND objid = :j AND objsubid = 2",
                j=job_id,
            )
        )
        os.kill(backend, signal.SIGSTOP)
    finally:
        first.kill()  # SIGKILL: no close(), nothing written at its end
        first.wait(timeout=60)
    resumed = threading.Timer(2.0, os.kill, (backend, signal.SIGCONT))
    resumed.start()

    third = make_driver(cfg, db, tmp_path, resume=True)
    try:
        # accepted: its lock died with the first driver's connection, once PostgreSQL saw it
        third.setup()
        job = rows(engine, "SELECT status::text, driver_epoch FROM jobs WHERE name = 'life'")[0]
        assert job == ("running", 2)
        # only now is the previous run recovered: its node declared dead, its lease requeued
        assert scalar(engine, "SELECT status::text FROM workers WHERE id = :w", w=node.id) == "dead"
        assert scalar(engine, "SELECT count(*) FROM episodes WHERE status = 'leased'") == 0
    finally:
        resumed.cancel()
        with contextlib.suppress(ProcessLookupError):  # it ended once it ran again
            os.kill(backend, signal.SIGCONT)
        third.close()
    assert scalar(engine, "SELECT status::text FROM jobs WHERE name = 'life'") == "stopped"
    kinds = [k for (k,) in rows(engine, "SELECT kind FROM events ORDER BY id")]
    assert kinds.count("job.driver_started") == 2 and kinds[-1] == "job.stopped"


def test_step_commits_and_claims_are_fenced_by_the_driver_epoch(
    db: Database, engine: sa.Engine
) -> None:
    """A driver that lost its job to another (its lock dropped with a database restart and a
    second driver took the job) cannot claim or commit a step, even without the lock."""
    add_tasks(db, {"name": "a", "group_size": 2})
    buf = make_buffer(db, batch_groups=2)
    buf.driver_epoch = scalar(engine, "SELECT driver_epoch FROM jobs WHERE id = 1")
    buf.seed()
    w = buf.register_worker("r0")
    drain_queue(buf, w.id, version=0)
    assert len(buf.claim_batch(0).groups) == 2
    with engine.begin() as conn:  # another driver takes the job over
        conn.execute(sa.text("UPDATE jobs SET driver_epoch = driver_epoch + 1 WHERE id = 1"))
    with pytest.raises(ConflictError, match="another driver"):
        buf.commit_step(0)
    with pytest.raises(ConflictError, match="another driver"):
        buf.claim_batch(0)
    assert scalar(engine, "SELECT policy_version FROM jobs WHERE id = 1") == 0
    assert scalar(engine, "SELECT count(*) FROM train_steps") == 0
    assert scalar(engine, "SELECT count(*) FROM trajectories WHERE status = 'consumed'") == 0


def test_job_stop_reaches_the_driver_and_db_stop_refuses_while_it_runs(
    cli: Any,
    db: Database,
    engine: sa.Engine,
    pg: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    driver = make_driver(config(tmp_path), db, tmp_path)
    try:
        driver.setup()
        show = json.loads(cli("job", "show", "life", "--json").out)
        assert show["status"] == "running" and show["driver"]["alive"] is True
        assert show["driver"]["pid"] == os.getpid()
        r = cli("job", "stop", "life")
        assert r.code == 0 and "stop requested" in r.out.lower(), r
        # the driver notices (its watch reads the job row) and asks its loop to stop
        wait_for("the driver to see the stop", driver._stop_requested.is_set, timeout_s=60)
        assert json.loads(cli("job", "show", "life", "--json").out)["status"] == "stopping"
        r = cli("job", "show", "life")
        assert "stopping" in r.out and f"pid {os.getpid()}" in r.out
        assert cli("job", "stop", "life").code == 0  # asking again is harmless
        assert json.loads(cli("status", "--job", "life", "--json").out)["job"]["status"] == (
            "stopping"
        )

        # `db stop` on the server the driver uses: refused without --yes
        monkeypatch.delenv("ROLLCALL_DATABASE_URL")
        r = cli("--home", str(pg.home), "db", "stop")
        assert r.code == 4 and "--yes" in r.err and "running" in r.err, r
        assert scalar(engine, "SELECT 1") == 1  # still up
    finally:
        driver.close()
    kinds = [k for (k,) in rows(engine, "SELECT kind FROM events ORDER BY id")]
    assert kinds.count("job.stop_requested") == 1 and kinds[-1] == "job.stopped"
    assert scalar(engine, "SELECT status::text FROM jobs WHERE name = 'life'") == "stopped"
    monkeypatch.setenv("ROLLCALL_DATABASE_URL", str(db.url.render_as_string(hide_password=False)))
    r = cli("job", "stop", "life")
    assert r.code == 4 and "no running driver" in r.err, r


def test_driver_takes_its_lock_again_after_a_database_restart(
    db: Database, engine: sa.Engine, pg: Any, tmp_path: Path
) -> None:
    from rollcall.orchestrator.db.embedded import EmbeddedPostgres

    cfg = config(tmp_path)
    driver = make_driver(cfg, db, tmp_path)
    try:
        driver.setup()
        server = EmbeddedPostgres(pg.home)
        server.stop()
        time.sleep(1.0)
        server.ensure_running()
        engine.dispose()

        def lock_held() -> bool:
            with engine.connect() as conn:
                return bool(
                    conn.scalar(
                        sa.text(
                            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                            "AND granted AND database = (SELECT oid FROM pg_database "
                            "WHERE datname = current_database())"
                        )
                    )
                )

        wait_for("the driver to take its lock again", lock_held, timeout_s=60)
        second = make_driver(cfg, db, tmp_path, resume=True)
        try:
            with pytest.raises(ConflictError, match=REFUSED):
                second.setup()
        finally:
            second.close()
        assert not driver._stop_requested.is_set()  # a healthy job is not stopped or fenced
    finally:
        driver.close()
    assert scalar(engine, "SELECT status::text FROM jobs WHERE name = 'life'") == "stopped"
