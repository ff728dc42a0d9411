"""Faults injected into running jobs (real processes, real PostgreSQL, real Ray, the tiny model):
a rollout node SIGKILLed mid-trajectory, one SIGSTOPped (a hang), a trainer rank killed between
its optimizer step and the step commit, a trainer rank frozen mid-step (its call times out),
PostgreSQL restarted mid-run. Afterwards the invariant
checker passes: nothing lost, nothing trained twice, nothing beyond its staleness bound."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from rich.console import Console

from rollcall.orchestrator import procfs
from rollcall.orchestrator.buffer.invariants import check_invariants
from rollcall.orchestrator.config import RollcallConfig
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.runner.driver import JobDriver, RunResult
from tests.integration.buffer_helpers import rows, scalar
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(420)


def _config(
    tmp: Path, model: Path, steps: int, nodes: int = 2, max_staleness: int = 2, **rollout: Any
) -> RollcallConfig:
    return RollcallConfig.model_validate(
        {
            "job": {"name": "chaos"},
            "model": {"path": str(model)},
            "buffer": {"batch_groups": 2, "lease_s": 30},
            "rollout": {
                "nodes": nodes,
                "concurrency": 3,
                "max_tokens_per_turn": 16,
                "max_tokens": 256,
                "heartbeat_interval_s": 0.5,
                "tool_timeout_s": 2.0,
                "restart_backoff_s": 0.5,
                "restart_window_s": 20.0,
                **rollout,
            },
            "trainer": {"lr": 1e-3, "micro_batch_tokens": 512, "restart_window_s": 20.0},
            "control_plane": {
                "seed_interval_s": 0.5,
                "dead_sweep_interval_s": 0.5,
                "heartbeat_timeout_s": 5.0,
                "progress_timeout_s": 10.0,
                "supervise_interval_s": 0.5,
            },
            "run": {
                "dir": str(tmp / "run"),
                "total_steps": steps,
                "eval": {"every": 0, "episodes": 1},
            },
            "tasks": [
                {
                    "name": "calc",
                    "plugin": "calculator",
                    "weight": 1,
                    "max_inflight": 4,
                    "max_staleness": max_staleness,
                    "spec": {"group_size": 2, "max_turns": 3},
                },
                {
                    "name": "guess",
                    "plugin": "guess",
                    "weight": 1,
                    "max_inflight": 4,
                    "max_staleness": max_staleness,
                    "spec": {"group_size": 2, "max_guesses": 4},
                },
            ],
        }
    )


def _driver(cfg: RollcallConfig, db: Database, model: Path, tmp: Path) -> JobDriver:
    return JobDriver(cfg, db, model_dir=model, home=tmp, console=Console(file=None), live=False)


def _run_with(
    driver: JobDriver, fault: Callable[[], None], *, stop_after_fault: bool = False
) -> RunResult:
    """Run the job in this thread while ``fault`` runs in another; both must finish. With
    ``stop_after_fault``, the job (its ``total_steps`` a ceiling) stops after the step during
    which ``fault`` returned: a fault that waits for its recovery never races the job's end."""
    errors: list[BaseException] = []

    def inject() -> None:
        try:
            fault()
        except BaseException as e:  # surfaced below
            errors.append(e)
        finally:
            if stop_after_fault:
                driver.request_stop()

    t = threading.Thread(target=inject, daemon=True)
    try:
        driver.setup()
        t.start()
        result = driver.run()
    finally:
        driver.close()
    t.join(timeout=60)
    if errors:
        raise errors[0]
    return result


def _assert_nothing_lost(db: Database, engine: sa.Engine, steps: int) -> None:
    job = scalar(engine, "SELECT id FROM jobs WHERE name = 'chaos'")
    report = check_invariants(db, job)
    assert report.ok, report.summary()
    assert [r[0] for r in rows(engine, "SELECT step FROM train_steps ORDER BY step")] == list(
        range(steps)
    )
    # every in-progress sample left behind by a dead node was resumed or is resumable
    assert scalar(engine, "SELECT count(*) FROM episodes WHERE status = 'leased'") == 0


def test_rollout_nodes_killed_and_hung_lose_nothing(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    # a ceiling: stopped after the fault. The bound is the widest: the tiny trainer takes a few
    # steps a second, and a resumed episode whose checkpointed turns fell out of a bound of 2
    # during the recovery is expired (its prompt queued again), never finished: the likely cause
    # of one CI failure (not reproduced here, twice, idle and beside three busy loops).
    cfg = _config(tmp_path, tiny_dir, steps=1000, max_staleness=1000)
    driver = _driver(cfg, db, tiny_dir, tmp_path)
    seen: dict[str, Any] = {}

    def node_with_checkpoint() -> Any:
        # a live rollout node holding an episode whose sample has a checkpointed turn
        got = rows(
            engine,
            """SELECT w.id, w.pid, w.name FROM workers w
               JOIN episodes e ON e.lease_owner = w.id AND e.status = 'leased'
               JOIN trajectories tr ON tr.episode_id = e.id AND tr.task_id = e.task_id
               WHERE w.role = 'rollout' AND w.status = 'alive' AND tr.status = 'in_progress'
               LIMIT 1""",
        )
        return got[0] if got else None

    def fault() -> None:
        wid, pid, name = wait_for("a node mid-trajectory", node_with_checkpoint)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        wait_for(
            "the killed node declared dead",
            lambda: rows(engine, "SELECT 1 FROM workers WHERE id = :w AND status = 'dead'", w=wid),
        )
        seen["kill_detect_s"] = time.monotonic() - t0
        wait_for(
            "its replacement",
            lambda: rows(
                engine,
                "SELECT 1 FROM workers WHERE name = :n AND id > :w AND status = 'alive'",
                n=name,
                w=wid,
            ),
        )
        seen["kill_recover_s"] = time.monotonic() - t0
        # now hang the other node: SIGSTOP, heartbeats stop, the sweep declares it dead
        other = wait_for(
            "the other node",
            lambda: rows(
                engine,
                "SELECT id, pid, name FROM workers WHERE role = 'rollout' "
                "AND status = 'alive' AND name <> :n",
                n=name,
            ),
        )[0]
        t1 = time.monotonic()
        os.kill(other[1], signal.SIGSTOP)
        wait_for(
            "the hung node declared dead",
            lambda: rows(
                engine, "SELECT 1 FROM workers WHERE id = :w AND status = 'dead'", w=other[0]
            ),
            timeout_s=60,
        )
        seen["hang_detect_s"] = time.monotonic() - t1
        wait_for(
            "the hung node's replacement",
            lambda: rows(
                engine,
                "SELECT 1 FROM workers WHERE name = :n AND id > :w AND status = 'alive'",
                n=other[2],
                w=other[0],
            ),
        )
        wait_for(
            "a requeued episode finished",
            lambda: scalar(engine, requeued_and_done),
            detail=lambda: rows(
                engine,
                "SELECT e.status, e.attempts, count(*), min(e.min_policy_version), "
                "max(j.policy_version) FROM episodes e JOIN jobs j ON j.id = e.job_id "
                "WHERE e.attempts >= 2 OR e.status = 'expired' GROUP BY 1, 2 ORDER BY 1, 2",
            ),
        )

    requeued_and_done = "SELECT count(*) FROM episodes WHERE attempts >= 2 AND status = 'done'"
    result = _run_with(driver, fault, stop_after_fault=True)
    assert result.steps >= 1
    _assert_nothing_lost(db, engine, result.steps)
    # detection: SIGKILL through Ray at once; the hang within interval + timeout + sweep
    assert seen["kill_detect_s"] < 10
    assert seen["hang_detect_s"] < 0.5 + 5.0 + 0.5 + 2.0  # bound plus scheduling slack
    kinds = [r[0] for r in rows(engine, "SELECT kind FROM events ORDER BY id")]
    assert "worker.dead" in kinds and kinds.count("worker.restarting") >= 2
    # the killed node's in-flight episode went back to the queue and was finished by a claimer
    assert scalar(engine, "SELECT sum(requeued_leases) FROM tasks") >= 1
    assert (
        scalar(engine, "SELECT count(*) FROM episodes WHERE attempts >= 2 AND status = 'done'") >= 1
    )


def test_trainer_rank_killed_before_the_step_commit_recovers(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    cfg = _config(tmp_path, tiny_dir, steps=3, nodes=1)
    driver = _driver(cfg, db, tiny_dir, tmp_path)
    killed: list[int] = []

    def kill_rank(d: JobDriver) -> None:
        if d.step == 1 and not killed:
            pid = d.trainer.info[0]["pid"]
            killed.append(pid)
            os.kill(pid, signal.SIGKILL)

    driver.fault_hooks["after_train"] = kill_rank
    result = _run_with(driver, lambda: None)
    assert killed and result.steps == 3
    _assert_nothing_lost(db, engine, 3)
    kinds = [r[0] for r in rows(engine, "SELECT kind FROM events ORDER BY id")]
    assert kinds.count("trainer.restarted") == 1
    # the replayed step trained on the batch reserved before the crash
    records = [r for r in driver.run_dir.records("step")]
    assert [r["step"] for r in records] == [0, 1, 2] and records[1]["replayed"] is True


def test_hung_trainer_times_out_while_supervision_goes_on(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    """A trainer rank frozen (SIGSTOP) between its optimizer step and the checkpoint: the
    driver's next trainer call times out (``trainer.call_timeout_s``) and the trainer goes
    through the normal recovery. A rollout node killed during the hang is restarted before
    that, since supervision does not wait on the trainer."""
    cfg = _config(tmp_path, tiny_dir, steps=3)
    cfg = cfg.model_copy(
        update={"trainer": cfg.trainer.model_copy(update={"call_timeout_s": 15.0})}
    )
    driver = _driver(cfg, db, tiny_dir, tmp_path)
    frozen: list[tuple[int, int] | None] = []

    def freeze_rank(d: JobDriver) -> None:
        if d.step == 1 and not frozen:
            pid = d.trainer.info[0]["pid"]
            frozen.append(procfs.identity(pid))
            os.kill(pid, signal.SIGSTOP)
            node = rows(
                engine, "SELECT pid FROM workers WHERE role = 'rollout' AND status = 'alive'"
            )[0][0]
            os.kill(node, signal.SIGKILL)

    driver.fault_hooks["after_train"] = freeze_rank
    try:
        result = _run_with(driver, lambda: None)
    finally:
        for ident in frozen:  # ray.kill took it down; never leave a stopped process behind
            procfs.signal_same(ident, signal.SIGKILL)  # (only if its pid is still its own)
    assert frozen and result.steps == 3
    _assert_nothing_lost(db, engine, 3)
    events = rows(engine, "SELECT kind, message FROM events ORDER BY id")
    kinds = [k for k, _ in events]
    assert kinds.count("trainer.restarted") == 1
    assert "TrainerTimeoutError" in next(m for k, m in events if k == "trainer.restarted")
    # the killed node was handled while the driver still waited on the frozen trainer
    assert kinds.index("worker.restarting") < kinds.index("trainer.restarted")
    records = driver.run_dir.records("step")
    assert [r["step"] for r in records] == [0, 1, 2] and records[1]["replayed"] is True


def test_database_restart_mid_run_declares_nobody_dead(
    ray_local: Any, pg: Any, tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    from rollcall.orchestrator.db.embedded import EmbeddedPostgres

    cfg = _config(tmp_path, tiny_dir, steps=4, nodes=1)
    driver = _driver(cfg, db, tiny_dir, tmp_path)
    outage: dict[str, float] = {}

    def fault() -> None:
        wait_for("the first step", lambda: scalar(engine, "SELECT count(*) FROM train_steps"))
        server = EmbeddedPostgres(pg.home)
        t0 = time.monotonic()
        server.stop()
        # longer than control_plane.heartbeat_timeout_s (5 s), within the retries' window
        time.sleep(cfg.control_plane.heartbeat_timeout_s + 1.5)
        server.ensure_running()
        outage["s"] = time.monotonic() - t0

    result = _run_with(driver, fault)
    assert result.steps == 4 and outage["s"] > cfg.control_plane.heartbeat_timeout_s
    engine.dispose()
    _assert_nothing_lost(db, engine, 4)
    kinds = [r[0] for r in rows(engine, "SELECT kind FROM events ORDER BY id")]
    assert "worker.dead" not in kinds and "worker.restarting" not in kinds
    # the restart dropped the driver's lock with its connection: it took it again, kept the
    # job (no fencing) and ended it as finished
    assert "job.driver_relocked" in kinds and "job.driver_fenced" not in kinds
    assert scalar(engine, "SELECT status::text FROM jobs WHERE name = 'chaos'") == "finished"
    assert kinds.count("database.outage") == 1  # the driver's, once the database was back
    assert "database unavailable" in (tmp_path / "run" / "driver.log").read_text()  # retries


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


def test_second_driver_is_refused_and_job_stop_ends_the_run_gracefully(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, cli: Any, tmp_path: Path
) -> None:
    import io
    import json

    from rollcall.orchestrator.errors import ConflictError

    cfg = _config(tmp_path, tiny_dir, steps=1000, nodes=1)  # a ceiling: `job stop` ends it

    def quiet_driver(resume: bool = False) -> JobDriver:  # its lines stay out of the CLI's output
        console = Console(file=io.StringIO())
        return JobDriver(
            cfg, db, model_dir=tiny_dir, home=tmp_path, resume=resume, console=console, live=False
        )

    driver = quiet_driver()
    in_step, go = threading.Event(), threading.Event()

    def hold(d: JobDriver) -> None:  # step 1 in progress: trained, not yet committed
        if d.step == 1:
            in_step.set()
            go.wait(300)

    driver.fault_hooks["after_train"] = hold

    def show() -> dict[str, Any]:
        return json.loads(cli("job", "show", "chaos", "--json").out)

    def fault() -> None:
        try:
            wait_for("step 1 in progress", in_step.is_set, timeout_s=300)
            assert show()["status"] == "running"
            before = _driver_state(engine)
            second = quiet_driver(resume=True)  # `rollcall run CONFIG --resume`, a second time
            try:
                with pytest.raises(ConflictError, match="already running under another driver"):
                    second.setup()
            finally:
                second.close()
            assert _driver_state(engine) == before  # the first driver's node is not dead

            r = cli("job", "stop", "chaos")
            assert r.code == 0 and "Stop requested" in r.out, r
            wait_for("the driver to see the stop", driver._stop_requested.is_set, timeout_s=60)
            assert show()["status"] == "stopping"
        finally:
            go.set()  # step 1 commits; then the loop sees the stop

    result = _run_with(driver, fault, stop_after_fault=True)  # stop_after: a failed fault
    assert result.steps == 2 and not result.stopped_early and result.final_dir
    assert (Path(result.final_dir) / "config.json").exists()  # saved as on a normal end
    assert show()["status"] == "stopped"
    engine.dispose()
    _assert_nothing_lost(db, engine, 2)
    assert scalar(engine, "SELECT count(*) FROM workers WHERE status <> 'stopped'") == 0
    kinds = [r[0] for r in rows(engine, "SELECT kind FROM events ORDER BY id")]
    for kind in ("job.driver_started", "job.driver_refused", "job.stop_requested"):
        assert kinds.count(kind) == 1, (kind, kinds)
    assert kinds[-1] == "job.stopped" and "worker.dead" not in kinds
    r = cli("job", "stop", "chaos")
    assert r.code == 4 and "no running driver" in r.err
