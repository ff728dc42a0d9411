"""Liveness apart from progress, starts apart from deaths, budgets that end crash loops and a
breaker for broken nodes, on real Ray, real PostgreSQL and the tiny model, with fakes only at
the engine seam (``tests/support/faults.py``):

- a node whose engine is merely slow (every call 12 s, longer than the heartbeat timeout),
  under CPU overload (busy loops, 3x the cores), is never declared dead and nothing is
  requeued; the same engine hung, still under the overload, is declared dead for want of
  progress, and its restart finishes the step;
- a node whose start is slower than ``start_timeout_s`` but beats is not restarted;
- a node whose constructor always fails ends ``failed`` after its budget (the job goes on
  with the other node), and a job left with no node stops with one sentence;
- a node whose engine raises on every call, beside a healthy one, quarantines nothing: its
  breaker trips and the healthy node does the work."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from ops.chaos import BusyLoops
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.errors import JobFailedError
from tests.chaos.test_faults import _assert_nothing_lost, _config, _driver, _run_with
from tests.integration.buffer_helpers import rows, scalar
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(600)

HOOKS = "tests.support.faults"


@pytest.fixture
def cpu_overload() -> Iterator[BusyLoops]:
    """Busy loops, three per core (``ops/chaos.py``'s overload), until ``end`` or the test's end."""
    with BusyLoops() as loops:
        yield loops


def _events(engine: sa.Engine, kind: str) -> list[Any]:
    return rows(engine, "SELECT message, payload FROM events WHERE kind = :k ORDER BY id", k=kind)


def _requeued(engine: sa.Engine) -> int:
    return int(scalar(engine, "SELECT coalesce(sum(requeued_leases), 0) FROM tasks"))


@pytest.mark.timeout(1200)
def test_slow_engine_under_cpu_overload_keeps_beating_and_a_hung_one_is_found(
    ray_local: Any,
    tiny_dir: Path,
    db: Database,
    engine: sa.Engine,
    tmp_path: Path,
    cpu_overload: BusyLoops,
) -> None:
    flags = tmp_path / "flags"
    flags.mkdir()
    # the default liveness bounds (beats every 2 s, dead after 10 s without one, hung after
    # 30 s without progress);
    # every generate call takes 12 s. One single-turn task and one group a step, so that a
    # step is a few calls. total_steps is a ceiling: the job stops once the node restarted
    # after the hang has finished a step
    cfg = _config(tmp_path, tiny_dir, steps=100, nodes=1, heartbeat_interval_s=2.0, concurrency=4)
    cp = cfg.control_plane.model_copy(
        update={"heartbeat_timeout_s": 10.0, "progress_timeout_s": 30.0}
    )
    calc = cfg.tasks[0].model_copy(update={"spec": {"group_size": 2, "max_turns": 1}})
    buffer = cfg.buffer.model_copy(update={"batch_groups": 1})
    cfg = cfg.model_copy(update={"control_plane": cp, "tasks": [calc], "buffer": buffer})
    driver = _driver(cfg, db, tiny_dir, tmp_path)
    driver.engine_hooks[0] = f"{HOOKS}:slow:{flags}"
    slow_phase: dict[str, Any] = {}

    def fault() -> None:
        # steps (weights published at each, loaded while the engine is busy) of a slow engine
        # under overload: no death, no requeue. Two are enough: each is a 12 s call, past
        # the 10 s heartbeat timeout (the test took 320 s of CI with four)
        wait_for("2 steps of the slow engine", lambda: driver.step >= 2, timeout_s=600)
        slow_phase["dead"] = _events(engine, "worker.dead")
        slow_phase["requeued"] = _requeued(engine)
        slow_phase["restarts"] = driver.supervisor.slots[0].restarts
        (flags / "hang").touch()  # now the engine hangs: its beats go on, its progress stops
        wait_for("the hung node declared dead", lambda: _events(engine, "worker.dead"), 120)
        (flags / "hang").unlink()
        # the overload ends with the phases it is for (it took the machine's CPU from the
        # tests beside this one for the node's restart and the job's last steps too); the
        # restarted node finishes a step
        cpu_overload.end()
        found = driver.step
        wait_for("a step by the restarted node", lambda: driver.step > found, timeout_s=300)
        (flags / "fast").touch()  # the job's last step (it stops after this) is not slowed

    result = _run_with(driver, fault, stop_after_fault=True)
    assert slow_phase["dead"] == [] and slow_phase["requeued"] == 0
    assert slow_phase["restarts"] == 0
    (message, payload), *_ = _events(engine, "worker.dead")
    assert "no generation progress" in payload["reason"], message
    # the job went on past the hang, on the restarted node's work
    assert result.steps >= 3
    _assert_nothing_lost(db, engine, result.steps)


def test_a_slow_start_that_beats_is_not_restarted(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    # the engine comes up 75 s after the node registered, past start_timeout_s (60 s): the
    # node registered first and beats, so it is starting, not dead. (With 30 s, a fresh-clone
    # CI run under load 6-7 saw the process itself take longer than that to register.)
    cfg = _config(tmp_path, tiny_dir, steps=2, nodes=1, start_timeout_s=60.0)
    driver = _driver(cfg, db, tiny_dir, tmp_path)
    driver.engine_hooks[0] = f"{HOOKS}:slow_start"
    result = _run_with(driver, lambda: None)
    assert result.steps == 2
    assert _events(engine, "worker.restarting") == [] and _events(engine, "worker.dead") == []
    assert scalar(engine, "SELECT count(*) FROM workers WHERE role = 'rollout'") == 1


def test_a_node_that_never_starts_ends_failed_and_the_job_goes_on(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    cfg = _config(tmp_path, tiny_dir, steps=500, nodes=2, max_restarts=2, restart_window_s=600)
    driver = _driver(cfg, db, tiny_dir, tmp_path)
    driver.engine_hooks[1] = f"{HOOKS}:never_starts"

    def fault() -> None:
        wait_for("rollout-1 over its budget", lambda: _events(engine, "worker.failed"), 300)

    result = _run_with(driver, fault, stop_after_fault=True)
    (message, payload), *more = _events(engine, "worker.failed")
    assert not more and payload["slot"] == "rollout-1" and payload["restarts"] == 3
    assert "FileNotFoundError" in payload["reason"], message
    assert len(_events(engine, "worker.restarting")) == 2
    assert driver.supervisor is None or driver.supervisor.slots[1].failed
    assert not _events(engine, "worker.added")  # a failed slot is not replaced by a new one
    assert result.steps >= 1  # rollout-0 kept the job going
    _assert_nothing_lost(db, engine, result.steps)


@pytest.mark.timeout(300)
def test_a_job_left_with_no_rollout_node_stops_with_one_sentence(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    cfg = _config(tmp_path, tiny_dir, steps=3, nodes=1, max_restarts=1, restart_window_s=600)
    driver = _driver(cfg, db, tiny_dir, tmp_path)
    driver.engine_hooks[0] = f"{HOOKS}:never_starts"
    with pytest.raises(JobFailedError) as err:
        _run_with(driver, lambda: None)
    text = str(err.value)
    assert "every rollout node failed" in text and "rollout.max_restarts" in text
    assert "\n" not in text
    assert len(_events(engine, "worker.failed")) == 1
    assert len(_events(engine, "job.no_rollout_nodes")) == 1


def test_a_broken_engine_beside_a_healthy_one_quarantines_nothing(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    # steps: a ceiling; the job stops once rollout-1's breaker tripped (else a fast healthy
    # node could finish the job before the broken one failed three episodes)
    cfg = _config(tmp_path, tiny_dir, steps=200, nodes=2, max_restarts=2, restart_window_s=600)
    driver = _driver(cfg, db, tiny_dir, tmp_path)
    driver.engine_hooks[1] = f"{HOOKS}:broken"

    def until_tripped() -> None:
        wait_for("rollout-1's breaker", lambda: _events(engine, "worker.breaker_tripped"), 300)
        # and a step trained from the healthy node's work (the breaker can trip first: seen
        # in CI, the job stopped at step 0)
        wait_for("a step from rollout-0", lambda: driver.step >= 1, 300)
        wait_for(
            "rollout-1 restarting",
            lambda: any(p["slot"] == "rollout-1" for _, p in _events(engine, "worker.restarting")),
            300,
        )

    result = _run_with(driver, until_tripped, stop_after_fault=True)
    assert result.steps >= 1
    assert scalar(engine, "SELECT coalesce(sum(quarantined_episodes), 0) FROM tasks") == 0
    assert scalar(engine, "SELECT count(*) FROM episodes WHERE status = 'quarantined'") == 0
    tripped = _events(engine, "worker.breaker_tripped")
    assert tripped and all("rollout-1" not in m or "RuntimeError" in m for m, _ in tripped)
    # its restart names the breaker, never a hang (the row is marked dead by the node's own
    # give-back before its run returns: that read as "declared dead ... (hung)")
    restarts = [p["reason"] for _, p in _events(engine, "worker.restarting")
                if p["slot"] == "rollout-1"]  # fmt: skip
    assert restarts and all("breaker tripped" in r or "NodeBroken" in r for r in restarts), restarts
    # the healthy node was never restarted and did the work
    assert scalar(engine, "SELECT max(incarnation) FROM workers WHERE name = 'rollout-0'") == 0
    _assert_nothing_lost(db, engine, result.steps)
