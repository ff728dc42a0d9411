"""Machines come and go under a running job, on a real multi-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``): the fleet is scaled up, a machine is drained, three machines
are lost with a spare each time (one by ``rollcall drill kill-node``, one SIGKILLed, one
frozen as a machine that loses power answers nothing), every rollout machine is gone for a
while, a machine joins, and the fleet is scaled down. The job never stops, no loss costs a
restart of the budget (``rollout.max_restarts: 1`` would fail a slot that two counted deaths
hit), and nothing checkpointed is lost or trained twice.

The job is the torch-free timing model (``ops/bench/pipeline.py``): what is tested here is
the supervisor, Ray's placement and the buffer, not the engine; its starts take a second."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from rich.console import Console

from ops.bench.pipeline import Setup, config_for
from rollcall.orchestrator import procfs
from rollcall.orchestrator.buffer.invariants import check_invariants
from rollcall.orchestrator.config import RollcallConfig
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.runner.driver import JobDriver
from rollcall.orchestrator.services.drills import DrillReport, Drills
from rollcall.orchestrator.services.jobs import scale
from rollcall.orchestrator.services.nodeloss import ray_node_processes
from rollcall.orchestrator.services.nodes import drain
from tests.integration.buffer_helpers import rows, scalar
from tests.support.cluster import ray_cluster
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(600)

STEPS = "SELECT count(*) FROM train_steps"
# Ray declares a machine that stopped answering dead after its health checks fail: here after
# about 5-10 s (by default 15-30 s: period 3 s x 5 failures plus a 10 s timeout); loose enough
# that a machine as loaded as a CI runner is not declared dead while it answers
FAST_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 2000,
    "health_check_failure_threshold": 5,
}


@pytest.fixture
def cluster(ray_local: Any) -> Iterator[Any]:
    """A head with the trainer's resource; the test adds the machines for rollout nodes."""
    with ray_cluster(num_cpus=2, resources={"trainer": 1}, _system_config=FAST_HEALTH_CHECKS) as c:
        yield c


def _job(tmp: Path) -> RollcallConfig:
    setup = Setup(
        nodes=1, concurrency=2, tasks=1, batch_groups=1, group_size=2, max_staleness=8,
        scale=0.004, steps=100_000, trainer={"s_per_token": 1e-4},
    )  # fmt: skip
    cfg = config_for(setup, "elastic", "", tmp / "run")
    data = cfg.model_dump()
    data["rollout"].update(
        resources={"rollout": 1}, restart_backoff_s=0.5, max_restarts=1,
        restart_window_s=600.0, start_timeout_s=60.0, drain_timeout_s=60.0,
    )  # fmt: skip
    data["trainer"].update(resources={"trainer": 1})
    data["control_plane"].update(
        heartbeat_timeout_s=5.0, dead_sweep_interval_s=0.5, supervise_interval_s=0.5,
        seed_interval_s=0.5,
    )  # fmt: skip
    return RollcallConfig.model_validate(data)


def test_machines_come_and_go_under_a_running_job(
    cluster: Any, tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    machine = {"A": cluster.add_node(num_cpus=1, resources={"rollout": 1})}
    cluster.wait_for_nodes()
    out = io.StringIO()
    driver = JobDriver(
        _job(tmp_path), db, model_dir=tiny_dir, home=tmp_path,
        console=Console(file=out, width=300), live=False,
    )  # fmt: skip
    outcome: dict[str, Any] = {}

    def run() -> None:  # the job in a thread: Ray's cluster_utils adds nodes from the main one
        try:
            outcome["result"] = driver.run()
        except BaseException as e:
            outcome["error"] = e

    def slots() -> dict[str, tuple[str, str | None]]:
        got = rows(engine, "SELECT name, state, ray_node_id FROM rollout_slots")
        return {n: (s, node) for n, s, node in got}

    def serving(name: str, node: Any) -> bool:
        return slots().get(name) == ("alive", node.node_id)

    def steps_go_on() -> None:
        at = scalar(engine, STEPS)
        wait_for(f"a step after {at}", lambda: scalar(engine, STEPS) > at, 120)

    frozen: list[tuple[int, int]] = []
    drilled: list[DrillReport] = []
    held: list[dict[str, Any]] = []  # samples the nodes held at each fault
    t = threading.Thread(target=run, daemon=True)
    try:
        driver.setup()
        job = driver.job_id
        t.start()
        wait_for("a first step", lambda: scalar(engine, STEPS), 120)
        assert serving("rollout-0", machine["A"]), (slots(), out.getvalue())
        assert "placed: " in out.getvalue()  # one line shows where the slots went

        # scale up: a second node, placed on the machine that joined for it
        machine["B"] = cluster.add_node(num_cpus=1, resources={"rollout": 1})
        with db.transaction() as tx:
            assert scale(tx, "elastic", 2, actor="test") == 1
        wait_for("rollout-1 serving on B", lambda: serving("rollout-1", machine["B"]), 120)

        # drain A with a spare: rollout-0 gives its episodes back and moves to the spare
        machine["C"] = cluster.add_node(num_cpus=1, resources={"rollout": 1})
        assert driver.lifecycle is not None
        gcs = driver.lifecycle.info["ray_address"]
        held += _held(db, engine, ["rollout-0"])
        drain(gcs, machine["A"].node_id, deadline_s=None, reason="test")
        wait_for("rollout-0 serving on C", lambda: serving("rollout-0", machine["C"]), 120)
        # moved to a machine with room: it never said it waited for capacity
        assert "rollout-0: waiting for capacity" not in out.getvalue(), out.getvalue()
        # the drained node stopped its samples at turn boundaries and gave the episodes back:
        # none was abandoned with a turn lost (a sample that found its lease given back
        # under it by another sample of its episode would be)
        assert driver.supervisor is not None
        drained = list(driver.supervisor.final_reports)
        assert drained and all(r["episodes_abandoned"] == 0 for r in drained), drained
        steps_go_on()

        # three machine losses, each with a spare that joined before it; none is counted.
        # The first is `rollcall drill kill-node` (tests/chaos/test_node_loss.py, the long
        # tier, drills it on the tiny model's hf nodes): its report is asserted below
        def lose(
            victim: str, spare: str, slot: str, *, freeze: bool = False, drill: bool = False
        ) -> None:
            machine[spare] = cluster.add_node(num_cpus=1, resources={"rollout": 1})
            wait_for(f"{spare} registered", lambda: _alive(machine[spare]), 60)
            held.extend(_held(db, engine, [slot]))
            if drill:  # the drill kills every process of the machine, and waits out recovery
                drilled.append(
                    Drills(db, "elastic", timeout_s=180).kill_node(machine[victim].node_id)
                )
            for pid, _ in ray_node_processes(machine[victim].node_id) if not drill else ():
                # frozen: a machine that loses power or its network answers nothing, and only
                # Ray's health checks find it dead. A process listed may be gone already (a
                # tool call's processes live for milliseconds).
                ident = procfs.identity(pid)
                if procfs.signal_same(ident, signal.SIGSTOP if freeze else signal.SIGKILL):
                    frozen.extend([ident] if freeze and ident is not None else [])
            wait_for(f"{slot} serving on {spare}", lambda: serving(slot, machine[spare]), 120)

        lose("B", "D", "rollout-1", drill=True)
        lose("C", "E", "rollout-0", freeze=True)
        lose("D", "F", "rollout-1")  # SIGKILLed
        steps_go_on()

        # every rollout machine lost, no spare: both slots wait for capacity, the job waits
        held += _held(db, engine, ["rollout-0", "rollout-1"])
        for m in ("E", "F"):
            for pid, _ in ray_node_processes(machine[m].node_id):
                with contextlib.suppress(ProcessLookupError):  # gone already
                    os.kill(pid, signal.SIGKILL)
        wait_for(
            "every slot waiting for capacity, and saying so",
            lambda: (
                {s for s, _ in slots().values()} == {"waiting_capacity"}
                and all(f"rollout-{i}: waiting for capacity" in out.getvalue() for i in (0, 1))
            ),
            90,
        )
        assert driver.supervisor.book.waiting_for_capacity() is not None  # the job waits

        # a machine joins: both slots are placed on it, the job continues without --resume
        machine["G"] = cluster.add_node(num_cpus=2, resources={"rollout": 2})
        wait_for(
            "both slots serving on G",
            lambda: serving("rollout-0", machine["G"]) and serving("rollout-1", machine["G"]),
            120,
        )
        steps_go_on()

        # scale down: rollout-1 drains (its turns given back) and is removed
        held += _held(db, engine, ["rollout-1"])
        with db.transaction() as tx:
            scale(tx, "elastic", 1, actor="test")
        wait_for("rollout-1 removed", lambda: slots()["rollout-1"][0] == "removed", 120)
        drained = list(driver.supervisor.final_reports)
        assert len(drained) >= 2 and all(r["episodes_abandoned"] == 0 for r in drained), drained
        steps_go_on()
    finally:
        driver.request_stop()
        t.join(timeout=120)
        stuck = t.is_alive()
        driver.close()
        for ident in frozen:  # the processes frozen, if still there (not their pids' heirs)
            procfs.signal_same(ident, signal.SIGKILL)
    timeline = _timeline(engine, out.getvalue())
    assert not stuck, f"the job did not stop\n{timeline}"
    assert "error" not in outcome, f"{outcome}\n{timeline}"
    # no loss, drain or scaling spent the budget: not one counted restart, no failed slot
    budget = rows(engine, "SELECT name, restarts, machine_losses, state FROM rollout_slots")
    assert all(r == 0 for _, r, _, _ in budget), f"{budget}\n{timeline}"
    # B, C, D (one each), E and F (both)
    assert sum(lost for _, _, lost, _ in budget) == 5, f"{budget}\n{timeline}"
    kinds = [k for (k,) in rows(engine, "SELECT kind FROM events")]
    assert "worker.restarting" not in kinds and "worker.failed" not in kinds, timeline
    # the kill-node drill on B: every process of the machine (the raylet and everything under
    # it) SIGKILLed, its slot declared dead and serving again on the spare, nothing lost or
    # trained twice, the trainer on the head undisturbed
    (drill,) = drilled
    print(json.dumps(drill.to_json()))  # the figures, with -s
    assert drill.passed, f"{drill.to_json()}\n{timeline}"
    assert "1 raylet" in drill.notes[0] and "agent" in drill.notes[0], drill.notes
    assert drill.lost == 0 and drill.duplicated == 0, drill.to_json()
    assert drill.detection_s is not None and drill.recovery_s is not None, drill.to_json()
    assert "rollout-1" in drill.target, drill.target
    assert "trainer.restarted" not in kinds, timeline
    assert "worker.drained" in kinds and "worker.removed" in kinds, timeline
    # the operator saw it: the waits, the placements, the losses
    text = out.getvalue()
    print(text)  # the driver's lines, with -s
    assert "waiting for capacity" in text and "after waiting" in text, text
    assert "after waiting -" not in text and "restarted (restart 0)" not in text, text
    assert "is lost" in text, text
    report = check_invariants(db, job)
    assert report.ok, f"{report.summary()}\n{timeline}"
    # what the drained, lost and removed nodes had checkpointed was kept: every sample they
    # held is at least as long now, or trained, or its group expired as stale
    assert _lost(db, held) == [], timeline


def _held(db: Database, engine: sa.Engine, names: list[str]) -> list[dict[str, Any]]:
    """The samples the slots' live incarnations hold now, with their tokens."""
    ids = [
        wid
        for wid, name in rows(
            engine, "SELECT id, name FROM workers WHERE status = 'alive' AND role = 'rollout'"
        )
        if name in names
    ]
    out: list[dict[str, Any]] = []
    with db.transaction() as tx:
        for wid in ids:
            out += [s for s in tx.invariants.samples_of_worker(wid) if s["num_tokens"]]
    return out


def _lost(db: Database, held: list[dict[str, Any]]) -> list[dict[str, Any]]:
    episodes = sorted({s["episode_id"] for s in held})
    with db.transaction() as tx:
        now = {
            (s["episode_id"], s["sample_index"]): s
            for s in tx.invariants.samples_of_episodes(episodes)
        }
    lost = []
    for s in held:
        cur = now.get((s["episode_id"], s["sample_index"]))
        if cur is not None and (
            cur["episode_status"] in ("expired", "quarantined") or cur["status"] == "expired"
        ):
            continue
        if cur is None or (cur["num_tokens"] or 0) < s["num_tokens"]:
            lost.append({"before": s, "now": cur})
    return lost


def _alive(node: Any) -> bool:
    import ray

    return any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes())


def _timeline(engine: sa.Engine, printed: str) -> str:
    workers = rows(
        engine,
        "SELECT id, name, status, left(node_id, 8), started_at::time, stopped_at::time "
        "FROM workers ORDER BY id",
    )
    events = rows(engine, "SELECT created_at::time, kind, message FROM events ORDER BY id")
    return "\n".join([f"worker {r}" for r in workers] + [f"event {r}" for r in events] + [printed])
