"""One job, many faults (real processes, real PostgreSQL, real Ray, the tiny model): a rollout
node SIGKILLed mid-trajectory; ``rollcall drill kill-rollout`` through the CLI; then
``ops/chaos.py``'s randomized driver (``run_chaos``) for six faults, one of every kind it has: a
rollout node SIGSTOPped (a hang), the database restarted, the trainer's rank killed, the
database kept down longer than the heartbeat timeout (an outage), a rollout node killed, a CPU
overload; then a second driver refused and ``rollcall job stop``. The job runs once per module
(``job``); each test asserts what one fault must show: detection, recovery, nothing lost or
trained twice, nobody falsely declared dead, the invariants. The 12-fault randomized run is the
long tier's (``-m long``)."""

from __future__ import annotations

import functools
import io
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from rich.console import Console

from rollcall.orchestrator.buffer.invariants import check_invariants
from rollcall.orchestrator.config import RollcallConfig
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.runner.driver import JobDriver
from rollcall.orchestrator.services.drills import Drills
from tests.chaos.test_faults import _assert_nothing_lost, _config, _driver
from tests.conftest import CliResult, job_database, run_cli
from tests.integration.buffer_helpers import rows, scalar
from tests.support.waiting import wait_for

# the module's job runs in its first test's set-up: that test's limit covers it
pytestmark = pytest.mark.timeout(900)

HEARTBEAT_BOUND_S = 0.5 + 5.0 + 0.5 + 2.0  # interval + timeout + sweep, plus scheduling slack
CHAOS_FAULTS = 6
CHAOS_SEED = 35  # its six faults: hang, restart-db, kill-trainer, db-outage, kill, overload


def _driver_state(engine: sa.Engine) -> dict[str, Any]:
    """What a second driver must not change: the job row's driver side, its workers, steps."""
    return {
        "job": rows(
            engine,
            "SELECT status::text, driver_epoch, driver, policy_version, pending_step, "
            "weights_version FROM jobs WHERE name = 'chaos'",
        ),
        "workers": rows(engine, "SELECT id, name, status::text FROM workers ORDER BY id"),
        "steps": rows(engine, "SELECT step, policy_version FROM train_steps ORDER BY step"),
    }


def _last_event(engine: sa.Engine) -> int:
    return int(scalar(engine, "SELECT coalesce(max(id), 0) FROM events"))


def _kinds(engine: sa.Engine, after: int = 0, upto: int | None = None) -> list[str]:
    sql = "SELECT kind FROM events WHERE id > :a AND id <= :b ORDER BY id"
    return [r[0] for r in rows(engine, sql, a=after, b=upto if upto is not None else 2**62)]


def _node_with_checkpoint(engine: sa.Engine) -> Any:
    """A live rollout node holding an episode whose sample has a checkpointed turn."""
    got = rows(
        engine,
        """SELECT w.id, w.pid, w.name FROM workers w
           JOIN episodes e ON e.lease_owner = w.id AND e.status = 'leased'
           JOIN trajectories tr ON tr.episode_id = e.id AND tr.task_id = e.task_id
           WHERE w.role = 'rollout' AND w.status = 'alive' AND tr.status = 'in_progress'
           LIMIT 1""",
    )
    return got[0] if got else None


REQUEUED_AND_DONE = "SELECT count(*) FROM episodes WHERE attempts >= 2 AND status = 'done'"


@dataclass
class Job:
    """What the module's job saw: per phase, its figures (``seen``) or the error that ended
    the faults (``failed``: the phases after it did not run)."""

    db: Database
    engine: sa.Engine
    cli: Callable[..., CliResult]
    driver: JobDriver
    cfg: RollcallConfig
    seen: dict[str, Any]
    failed: dict[str, BaseException]
    result: Any = None
    error: BaseException | None = None

    def phase(self, name: str) -> dict[str, Any]:
        """The figures of phase ``name``; an error naming the phase that failed otherwise."""
        if name in self.seen:
            return self.seen[name]
        for failed, e in self.failed.items():
            raise AssertionError(f"phase {name!r} did not finish: {failed!r} failed") from e
        raise AssertionError(f"phase {name!r} did not run")


@pytest.fixture(scope="module")
def job(
    ray_local: Any,
    pg: Any,
    template_url: str,
    tiny_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Job]:
    from ops.chaos import run_chaos
    from rollcall.orchestrator.db.embedded import EmbeddedPostgres

    with job_database(pg, "chaos_job") as (url, db, engine):
        tmp = tmp_path_factory.mktemp("chaos-job")
        raw = _config(tmp, tiny_dir, steps=1000).model_dump()  # a ceiling: `job stop` ends it
        # calc's bound is the widest: a resumed episode whose checkpointed turns fell out of a
        # bound of 2 during a recovery is expired (its prompt queued again), never finished, and
        # the killed node's episode must finish; guess keeps a bound of 2 for the invariants
        raw["tasks"][0]["max_staleness"] = 1000
        cfg = RollcallConfig.model_validate(raw)
        driver = JobDriver(
            cfg, db, model_dir=tiny_dir, home=tmp, console=Console(file=io.StringIO()), live=False
        )
        job = Job(db, engine, functools.partial(run_cli, url), driver, cfg, {}, {})
        hold, in_step, go = threading.Event(), threading.Event(), threading.Event()

        def hold_step(d: JobDriver) -> None:  # a step in progress: trained, not yet committed
            if hold.is_set() and not in_step.is_set():
                job.seen["held_step"] = d.step
                in_step.set()
                go.wait(300)

        driver.fault_hooks["after_train"] = hold_step
        done = threading.Event()

        def run() -> None:
            try:
                job.result = driver.run()
            except BaseException as e:
                job.error = e
            finally:
                done.set()

        server = EmbeddedPostgres(pg.home)
        log = Path()  # driver.log, once set up (the closures read it then)

        def restart() -> None:
            server.stop()
            server.ensure_running()

        def outage() -> None:  # longer than the heartbeat timeout, within the retries
            o = job.seen["outage"] = {
                "after": _last_event(engine),
                "log_at": log.stat().st_size if log.exists() else 0,
            }
            t0 = time.monotonic()
            server.stop()
            time.sleep(cfg.control_plane.heartbeat_timeout_s + 1.5)
            server.ensure_running()
            o["s"] = time.monotonic() - t0

        lines: list[str] = []

        def say(line: str) -> None:
            print(line)  # each fault's line, in the report of a failure
            lines.append(line)
            if "db-outage" in line and "outage" in job.seen:  # recovered: the outage's window ends
                job.seen["outage"]["upto"] = _last_event(engine)

        def show() -> dict[str, Any]:
            return json.loads(job.cli("job", "show", "chaos", "--json").out)

        def kill_mid_trajectory() -> dict[str, Any]:
            wid, pid, name = wait_for(
                "a node mid-trajectory", lambda: _node_with_checkpoint(engine)
            )
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            wait_for(
                "the killed node declared dead",
                lambda: rows(
                    engine, "SELECT 1 FROM workers WHERE id = :w AND status = 'dead'", w=wid
                ),
            )
            detect = time.monotonic() - t0
            wait_for(
                "its replacement",
                lambda: rows(
                    engine,
                    "SELECT 1 FROM workers WHERE name = :n AND id > :w AND status = 'alive'",
                    n=name,
                    w=wid,
                ),
            )
            return {"detect_s": detect, "recover_s": time.monotonic() - t0}

        def cli_kill() -> dict[str, Any]:
            # through the CLI: SIGKILL the busiest rollout node
            r = job.cli("drill", "kill-rollout", "--job", "chaos", "--json", "--yes")
            assert r.code == 0, r.out + r.err
            # (Ray's own log lines may share stdout; the report starts at a line's "{")
            at = 0 if r.out.startswith("{") else r.out.index("\n{") + 1
            report, _ = json.JSONDecoder().raw_decode(r.out[at:])
            # Ray's paragraph about the killed actor goes to driver.log, not the terminal
            wait_for(
                "Ray's message about the killed node in driver.log",
                lambda: log.exists() and "A worker died or was killed" in log.read_text(),
                timeout_s=60,
            )
            return {"report": report, "out": r.out}

        def chaos() -> dict[str, Any]:
            totals = run_chaos(
                Drills(db, "chaos", timeout_s=90),
                CHAOS_FAULTS,
                seed=CHAOS_SEED,
                restart_db=restart,
                outage=outage,
                overload_s=10.0,  # twice the heartbeat timeout
                say=say,
            )
            return {"totals": totals, "lines": lines}

        def requeued_done() -> dict[str, Any]:
            wait_for(
                "a requeued episode finished",
                lambda: scalar(engine, REQUEUED_AND_DONE),
                detail=lambda: rows(
                    engine,
                    "SELECT e.status, e.attempts, count(*), min(e.min_policy_version), "
                    "max(j.policy_version) FROM episodes e JOIN jobs j ON j.id = e.job_id "
                    "WHERE e.attempts >= 2 OR e.status = 'expired' GROUP BY 1, 2 ORDER BY 1, 2",
                ),
            )
            return {}

        def second_driver_and_stop() -> dict[str, Any]:
            from rollcall.orchestrator.errors import ConflictError

            seen: dict[str, Any] = {"after": _last_event(engine)}
            try:
                hold.set()
                wait_for("a step in progress", in_step.is_set, timeout_s=300)
                seen["status_held"] = show()["status"]
                seen["alive"] = [
                    r[0] for r in rows(engine, "SELECT id FROM workers WHERE status = 'alive'")
                ]
                before = _driver_state(engine)
                second = JobDriver(  # `rollcall run CONFIG --resume`, a second time
                    cfg,
                    db,
                    model_dir=tiny_dir,
                    home=tmp,
                    resume=True,
                    console=Console(file=io.StringIO()),
                    live=False,
                )
                try:
                    with pytest.raises(ConflictError, match="already running under another driver"):
                        second.setup()
                finally:
                    second.close()
                seen["unchanged"] = _driver_state(engine) == before  # the first driver's nodes live
                seen["stop"] = job.cli("job", "stop", "chaos")
                wait_for("the driver to see the stop", driver._stop_requested.is_set, timeout_s=60)
                seen["status_stopping"] = show()["status"]
            finally:
                go.set()  # the step commits; then the loop sees the stop
            return seen

        phases: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("kill_mid_trajectory", kill_mid_trajectory),
            ("cli_kill", cli_kill),
            ("chaos", chaos),
            ("requeued_done", requeued_done),
            ("stop", second_driver_and_stop),
        ]
        driver.setup()
        log = driver.run_dir.log_path
        threading.Thread(target=run, daemon=True).start()
        try:
            wait_for("a first step", lambda: scalar(engine, "SELECT count(*) FROM train_steps"))
            for phase, inject in phases:
                try:
                    job.seen[phase] = inject()
                except BaseException as e:
                    job.failed[phase] = e
                    break
        finally:
            if "stop" not in job.seen:
                driver.request_stop()
            go.set()
            done.wait(timeout=240)
            driver.close()
        engine.dispose()
        job.seen["final_status"] = show()["status"]
        job.seen["kinds_at_end"] = _kinds(engine)
        job.seen["stop_again"] = job.cli("job", "stop", "chaos")
        yield job


def _ended(job: Job) -> Any:
    assert job.error is None, repr(job.error)
    assert job.result is not None
    return job.result


def test_a_node_killed_mid_trajectory_is_replaced_and_its_episode_finished(job: Job) -> None:
    kill = job.phase("kill_mid_trajectory")
    job.phase("requeued_done")
    # detection: SIGKILL through Ray at once
    assert kill["detect_s"] < 10, kill
    kinds = _kinds(job.engine)
    assert "worker.dead" in kinds and kinds.count("worker.restarting") >= 2
    # the killed node's in-flight episode went back to the queue and was finished by a claimer
    assert scalar(job.engine, "SELECT sum(requeued_leases) FROM tasks") >= 1
    assert scalar(job.engine, REQUEUED_AND_DONE) >= 1


def test_drill_kill_rollout_through_the_cli(job: Job) -> None:
    seen = job.phase("cli_kill")
    kill = seen["report"]
    assert kill["passed"] and kill["lost"] == 0 and kill["duplicated"] == 0, kill
    assert kill["detection_s"] < 10 and kill["recovery_s"] < 60, kill
    # Ray's paragraph about the killed actor goes to driver.log (waited for), not the terminal
    assert "(raylet)" not in seen["out"]


def test_chaos_faults_of_every_kind_lose_nothing(job: Job) -> None:
    """``run_chaos`` for six faults, one of each kind (the long tier runs twelve): each
    detected and recovered, nothing lost or trained twice, nobody declared dead beyond the
    faults' targets (the overload's and the outages' targets are nobody)."""
    totals = job.phase("chaos")["totals"]
    assert totals["faults"] == CHAOS_FAULTS and len(totals["by_kind"]) == 6, totals
    # a failure's message names its faults and what the control plane saw
    why = "\n".join(totals["failed_faults"]) + "\n" + json.dumps(totals)
    assert totals["lost"] == 0 and totals["duplicated"] == 0 and totals["failed"] == 0, why
    assert totals["false_deaths"] == 0, totals
    # the hang (one): heartbeats stop, the sweep declares it dead within the bound
    assert totals["rollout_hang_detection_p50_s"] < HEARTBEAT_BOUND_S, totals
    assert totals["rollout_kill_detection_p50_s"] < 10, totals
    # every drill recorded its report (the CLI's kill, and all of run_chaos's but the overload)
    events = _kinds(job.engine)
    assert [k for k in events if k.startswith("drill.")] == ["drill.completed"] * 6


def test_database_outage_declares_nobody_dead(job: Job) -> None:
    """PostgreSQL down longer than ``control_plane.heartbeat_timeout_s`` mid-run: nobody is
    declared dead or restarted for it, the driver takes its lock again (the restart dropped it
    with its connection) and keeps the job (no fencing), its calls retried meanwhile."""
    job.phase("chaos")
    o = job.seen["outage"]
    assert o["s"] > job.cfg.control_plane.heartbeat_timeout_s
    assert "upto" in o, "the outage's fault was not reported"
    during = _kinds(job.engine, o["after"], o["upto"])
    assert "worker.dead" not in during and "worker.restarting" not in during, during
    assert "job.driver_relocked" in during, during
    assert "job.driver_fenced" not in _kinds(job.engine)
    # the driver's, once it was back (the events' messages name each outage's span)
    assert during.count("database.outage") == 1, rows(
        job.engine,
        "SELECT kind, message FROM events WHERE id > :a AND id <= :b ORDER BY id",
        a=o["after"],
        b=o["upto"],
    )
    log = job.driver.run_dir.log_path.read_text()
    assert "database unavailable" in log[o["log_at"] :]  # its retries


def test_second_driver_is_refused_and_job_stop_ends_the_run_gracefully(job: Job) -> None:
    seen = job.phase("stop")
    result = _ended(job)
    assert seen["status_held"] == "running"
    assert seen["unchanged"]  # the second driver changed nothing: the first's nodes not dead
    r = seen["stop"]
    assert r.code == 0 and "Stop requested" in r.out, r
    assert seen["status_stopping"] == "stopping"
    # the held step committed, then the loop saw the stop; the same driver ended the job
    assert result.steps == job.seen["held_step"] + 1
    assert not result.stopped_early and result.final_dir
    assert (Path(result.final_dir) / "config.json").exists()  # saved as on a normal end
    assert job.seen["final_status"] == "stopped"
    # every worker alive at the stop was stopped; none is left otherwise
    status = dict(rows(job.engine, "SELECT id, status::text FROM workers"))
    assert all(status[w] == "stopped" for w in seen["alive"]), status
    assert not [w for w, s in status.items() if s not in ("stopped", "dead", "failed")], status
    kinds = job.seen["kinds_at_end"]
    for kind in ("job.driver_started", "job.driver_refused", "job.stop_requested"):
        assert kinds.count(kind) == 1, (kind, kinds)
    assert kinds[-1] == "job.stopped" and "worker.dead" not in _kinds(job.engine, seen["after"])
    again = job.seen["stop_again"]
    assert again.code == 4 and "no running driver" in again.err, again


def test_invariants_hold_and_nothing_is_lost_after_every_fault(job: Job) -> None:
    for phase in ("kill_mid_trajectory", "cli_kill", "chaos", "requeued_done", "stop"):
        job.phase(phase)
    result = _ended(job)
    _assert_nothing_lost(job.db, job.engine, result.steps)
    report = check_invariants(job.db, scalar(job.engine, "SELECT id FROM jobs"))
    assert report.ok, report.summary()


@pytest.mark.long  # per push: test_chaos_faults_of_every_kind_lose_nothing (6 faults)
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
