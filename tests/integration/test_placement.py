"""The job's resources are reserved in Ray at start (one placement-group bundle per trainer rank
and per rollout node slot): a job larger than the cluster is refused with one sentence before
anything starts, and a restarted trainer gets its slot back even when another actor waits for
a CPU. Jobs with the torch-free timing-model trainer and engine (``ops/bench/pipeline.py``)."""

from __future__ import annotations

import io
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from rich.console import Console

from ops.bench.pipeline import Setup, config_for
from rollcall.orchestrator.config import RollcallConfig
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.errors import UserError
from rollcall.orchestrator.runner.driver import JobDriver
from tests.integration.buffer_helpers import rows, scalar

pytestmark = pytest.mark.timeout(420)


def timing_job(tmp: Path, name: str, *, nodes: int = 1, steps: int = 3, **trainer: Any) -> Any:
    """A small timing-model job whose trainer rank and rollout nodes take 1 CPU each."""
    setup = Setup(
        nodes=nodes, concurrency=2, tasks=1, batch_groups=1, group_size=2, max_staleness=3,
        scale=0.004, steps=steps, trainer={"s_per_token": 1e-4},
    )  # fmt: skip
    cfg: RollcallConfig = config_for(setup, name, "", tmp / "run")
    return cfg.model_copy(
        update={
            "rollout": cfg.rollout.model_copy(update={"cpus_per_node": 1.0}),
            "trainer": cfg.trainer.model_copy(update={"cpus_per_rank": 1.0, **trainer}),
        }
    )


def timing_driver(cfg: Any, db: Database, model: Path, tmp: Path) -> tuple[JobDriver, io.StringIO]:
    out = io.StringIO()
    console = Console(file=out, width=200)
    return JobDriver(cfg, db, model_dir=model, home=tmp, console=console, live=False), out


def _live_placement_groups() -> list[Any]:
    from ray.util.placement_group import placement_group_table

    return [pg for pg in placement_group_table().values() if pg["state"] != "REMOVED"]


def test_a_job_larger_than_the_cluster_is_refused_before_anything_starts(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    import ray

    cpus = int(ray.cluster_resources()["CPU"])  # the tests' local Ray: 8
    cfg = timing_job(tmp_path, "toobig", nodes=cpus)  # cpus nodes + 1 trainer rank
    driver, _ = timing_driver(cfg, db, tiny_dir, tmp_path)
    try:
        with pytest.raises(UserError) as refused:
            driver.setup()
    finally:
        driver.close()
    msg = str(refused.value)
    assert "\n" not in msg
    assert f"{cpus + 1:g} CPU" in msg and f"{cpus:g}" in msg, msg
    assert "rollout.nodes" in msg and "trainer.ranks" in msg, msg
    # nothing was started: no trainer, no rollout node, no reservation left behind
    assert driver.trainer is None and driver.supervisor is None
    assert scalar(engine, "SELECT count(*) FROM workers") == 0
    assert _live_placement_groups() == []
    # and the refused job wrote nothing: no job row, no task, no event
    assert scalar(engine, "SELECT count(*) FROM jobs WHERE name = 'toobig'") == 0
    assert scalar(engine, "SELECT count(*) FROM events WHERE kind LIKE 'job.%'") == 0


class _Waiter:
    def ping(self) -> bool:
        return True


def test_a_killed_trainer_gets_its_reserved_slot_back_before_a_waiting_actor(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    """Ray has exactly the job's CPUs free (the rest held by a filler); another actor asking
    for a CPU waits. The trainer is SIGKILLed: its CPU goes back to the job's reservation, so
    the restart gets it and the waiting actor does not (without a reservation the waiting
    actor took it and the restart waited forever)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    cfg = timing_job(tmp_path, "slot", nodes=1, steps=3)
    free = ray.available_resources().get("CPU", 0.0)
    filler = placement_group([{"CPU": free - 2}]) if free > 2 else None
    if filler is not None:
        ray.get(filler.ready(), timeout=60)
    driver, out = timing_driver(cfg, db, tiny_dir, tmp_path)
    waiting: list[Any] = []

    def kill_trainer(d: JobDriver) -> None:
        if d.step == 1 and not waiting:
            waiting.append(ray.remote(num_cpus=1)(_Waiter).remote())  # no CPU free: it waits
            os.kill(d.trainer.info[0]["pid"], signal.SIGKILL)

    driver.fault_hooks["after_train"] = kill_trainer
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = driver.run()
        except BaseException as e:
            outcome["error"] = e

    t = threading.Thread(target=run, daemon=True)
    stole = None
    try:
        driver.setup()
        t.start()
        t.join(timeout=240)
        stuck = t.is_alive()
        if waiting:  # before close() frees the reservation
            ready, _ = ray.wait([waiting[0].ping.remote()], timeout=0)
            stole = bool(ready)
    finally:
        for w in waiting:  # frees a stolen CPU, so a stuck restart can finish
            ray.kill(w)
        t.join(timeout=120)
        driver.close()
        if filler is not None:
            remove_placement_group(filler)
    assert waiting, "the fault was not injected"
    assert not stuck, f"the restarted trainer never got a CPU\n{out.getvalue()}"
    assert "error" not in outcome, outcome
    assert outcome["result"].steps == 3
    assert stole is False, "the waiting actor took the trainer's reserved CPU"
    kinds = [k for (k,) in rows(engine, "SELECT kind FROM events ORDER BY id")]
    assert kinds.count("trainer.down") == 1 and kinds.count("trainer.restarted") == 1
