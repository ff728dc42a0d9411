"""``rollcall drill`` against a running job: kill a rollout node, hang one, kill the trainer,
restart the database. Each report shows detection and recovery, and nothing lost or duplicated.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from rollcall.orchestrator.buffer.invariants import check_invariants
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.services.drills import Drills
from tests.chaos.test_faults import _config, _driver
from tests.integration.buffer_helpers import rows, scalar
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(600)


def test_drills_against_a_running_job(
    ray_local: Any,
    pg: Any,
    cli: Any,
    tiny_dir: Path,
    db: Database,
    engine: sa.Engine,
    tmp_path: Path,
) -> None:
    from rollcall.orchestrator.db.embedded import EmbeddedPostgres

    # total_steps is a ceiling: the job must outlive the drills, and is stopped after them
    driver = _driver(_config(tmp_path, tiny_dir, steps=1000), db, tiny_dir, tmp_path)
    driver.setup()
    done = threading.Event()
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["run"] = driver.run()
        except BaseException as e:
            result["error"] = e
        finally:
            done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        wait_for("a first step", lambda: scalar(engine, "SELECT count(*) FROM train_steps"))
        drills = Drills(db, "chaos", timeout_s=90)

        # through the CLI: SIGKILL the busiest rollout node
        r = cli("drill", "kill-rollout", "--job", "chaos", "--json", "--yes")
        assert r.code == 0, r.out + r.err
        # (in this process Ray's own log lines share stdout; the report starts at "{")
        kill = json.loads(r.out[r.out.index("\n{") + 1 :] if not r.out.startswith("{") else r.out)
        assert kill["passed"] and kill["lost"] == 0 and kill["duplicated"] == 0
        assert kill["detection_s"] < 10 and kill["recovery_s"] < 60
        # Ray's paragraph about the killed actor goes to driver.log, not the terminal
        assert "(raylet)" not in r.out
        log = driver.run_dir.log_path
        wait_for(
            "Ray's message about the killed node in driver.log",
            lambda: log.exists() and "A worker died or was killed" in log.read_text(),
            timeout_s=60,
        )

        hang = drills.kill_rollout(1, "STOP")[0]
        assert hang.passed, hang.to_json()
        # bound: heartbeat interval + timeout + sweep interval (0.5 + 5 + 0.5) plus slack
        assert hang.detection_s is not None and hang.detection_s < 8.0

        trainer = drills.kill_trainer()
        assert trainer.passed, trainer.to_json()

        server = EmbeddedPostgres(pg.home)

        def restart() -> None:
            server.stop()
            server.ensure_running()

        outage = drills.restart_db(restart)
        assert outage.passed, outage.to_json()
    finally:
        driver.request_stop()
        done.wait(timeout=240)
        driver.close()
    assert "error" not in result, result.get("error")
    job = scalar(engine, "SELECT id FROM jobs WHERE name = 'chaos'")
    report = check_invariants(db, job)
    assert report.ok, report.summary()
    events = [r[0] for r in rows(engine, "SELECT kind FROM events WHERE kind LIKE 'drill.%'")]
    assert events == ["drill.completed"] * 4


def test_randomized_chaos_run_loses_nothing(
    ray_local: Any, pg: Any, tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    from ops.chaos import run_chaos
    from rollcall.orchestrator.db.embedded import EmbeddedPostgres

    # a ceiling, as above
    driver = _driver(_config(tmp_path, tiny_dir, steps=5000), db, tiny_dir, tmp_path)
    driver.setup()
    done = threading.Event()
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["run"] = driver.run()
        except BaseException as e:
            result["error"] = e
        finally:
            done.set()

    server = EmbeddedPostgres(pg.home)

    def restart() -> None:
        server.stop()
        server.ensure_running()

    def outage() -> None:  # longer than the heartbeat timeout, within the retries
        server.stop()
        time.sleep(driver.cfg.control_plane.heartbeat_timeout_s + 1.5)
        server.ensure_running()

    threading.Thread(target=run, daemon=True).start()
    try:
        wait_for("a first step", lambda: scalar(engine, "SELECT count(*) FROM train_steps"))
        # twelve faults, the seed picked so that all six kinds come (four rollout kills, two
        # hangs, two trainer kills, two database restarts, an outage, an overload phase); the
        # long run (200 faults) is ops/chaos.py's, its figures in ops/bench/RESULTS.md
        totals = run_chaos(
            Drills(db, "chaos", timeout_s=90),
            12,
            seed=27,
            restart_db=restart,
            outage=outage,
            overload_s=20.0,
            say=print,  # each fault's line, in the report of a failure
        )
    finally:
        driver.request_stop()
        done.wait(timeout=240)
        driver.close()
    assert "error" not in result, result.get("error")
    assert totals["faults"] == 12 and len(totals["by_kind"]) == 6, totals
    # a failure's message names its faults and what the control plane saw (a str message
    # is shown whole, a dict's repr cut short)
    why = "\n".join(totals["failed_faults"]) + "\n" + json.dumps(totals)
    assert totals["lost"] == 0 and totals["duplicated"] == 0 and totals["failed"] == 0, why
    assert totals["false_deaths"] == 0, totals
    job = scalar(engine, "SELECT id FROM jobs WHERE name = 'chaos'")
    report = check_invariants(db, job)
    assert report.ok, report.summary()
    print(json.dumps(totals))
