"""The collective weight transport in a real job (``trainer.weights.transport: collective``):
the trainer's rank 0 broadcasts every version over gloo to two rollout nodes (Ray actors, the
tiny model on the hf engine), which load it in place; a node SIGKILLed or SIGSTOPped in the
middle of a broadcast is dropped, the group is re-formed from the other node and the version
completes there, the lost node is restarted and catches up from the version's file (a late
joiner), and the job goes on with nothing lost or duplicated."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from rich.console import Console

from rollcall.orchestrator.buffer.invariants import check_invariants
from rollcall.orchestrator.config import RollcallConfig
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.runner.driver import JobDriver
from tests.integration.buffer_helpers import rows, scalar
from tests.support.waiting import wait_for

SUPPORT = "tests.support.weights"
# enough for the lost node to be restarted and rejoin before the end: it is lost at version 1
# (a stopped one maybe again at 2, before it is found hung), and each publication waits for
# both nodes to be members (``both_members``): the versions after the losses reach both
STEPS = 5


def config(tmp: Path, model: Path, steps: int, **rollout: Any) -> RollcallConfig:
    return RollcallConfig.model_validate(
        {
            "job": {"name": "bcast"},
            "model": {"path": str(model)},
            "buffer": {"batch_groups": 2, "lease_s": 30},
            "rollout": {
                "nodes": 2,
                "concurrency": 2,
                "max_tokens_per_turn": 12,
                "max_tokens": 256,
                "heartbeat_interval_s": 0.5,
                "restart_backoff_s": 0.5,
                **rollout,
            },
            "trainer": {
                "lr": 1e-3,
                "micro_batch_tokens": 512,
                # 64 kB buckets: the tiny model's version is dozens of them
                "weights": {"transport": "collective", "timeout_s": 5.0, "bucket_mb": 0.0625},
            },
            "control_plane": {
                "seed_interval_s": 0.5,
                "dead_sweep_interval_s": 0.5,
                "heartbeat_timeout_s": 5.0,
                "progress_timeout_s": 45.0,
                "supervise_interval_s": 0.5,
            },
            "run": {
                "dir": str(tmp / "run"),
                "total_steps": steps,
                "mode": "sync",
                "eval": {"every": 0, "episodes": 0},
            },
            "tasks": [
                {
                    "name": "calc",
                    "plugin": "calculator",
                    "max_inflight": 4,
                    "max_staleness": 1,
                    "spec": {"group_size": 2, "max_turns": 2},
                }
            ],
        }
    )


def run_job(
    cfg: RollcallConfig,
    db: Database,
    model: Path,
    tmp: Path,
    hook: str | None,
    after_train: Callable[[JobDriver], None] | None = None,
) -> Any:
    driver = JobDriver(cfg, db, model_dir=model, home=tmp, console=Console(file=None), live=False)
    if hook is not None:
        driver.engine_hooks[1] = hook
    if after_train is not None:
        driver.fault_hooks["after_train"] = after_train
    try:
        driver.setup()
        return driver.run()
    finally:
        driver.close()


def broadcasts(engine: sa.Engine) -> list[dict[str, Any]]:
    return [
        r[0]
        for r in rows(
            engine, "SELECT payload FROM events WHERE kind = 'weights.broadcast' ORDER BY id"
        )
    ]


def nothing_lost(db: Database, engine: sa.Engine, steps: int) -> None:
    job = scalar(engine, "SELECT id FROM jobs WHERE name = 'bcast'")
    report = check_invariants(db, job)
    assert report.ok, report.summary()
    assert scalar(engine, "SELECT count(*) FROM train_steps") == steps
    assert scalar(engine, "SELECT count(*) FROM episodes WHERE status = 'leased'") == 0
    assert scalar(engine, "SELECT count(*) FROM episodes WHERE status = 'quarantined'") == 0


@pytest.mark.timeout(600)
def test_every_version_is_broadcast_to_both_nodes(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    cfg = config(tmp_path, tiny_dir, 4)
    # evaluation loads each version's file, written in the background
    cfg = cfg.model_copy(
        update={
            "run": cfg.run.model_copy(
                update={"eval": cfg.run.eval.model_copy(update={"every": 2, "episodes": 1})}
            )
        }
    )
    result = run_job(cfg, db, tiny_dir, tmp_path, None)
    assert result.steps == 4
    events = broadcasts(engine)
    assert [e["version"] for e in events] == [1, 2, 3, 4]
    for e in events:  # one group each, every member loaded it, nobody dropped
        assert sorted(e["loaded"]) == sorted(e["members"]), e
        assert len(e["epochs"]) == (1 if e["members"] else 0), e
        assert not e["dropped"] and not e["errors"], e
    # both nodes are members once up (a node still starting catches up from the files)
    assert all(sorted(e["loaded"]) == ["rollout-0", "rollout-1"] for e in events[-2:]), events
    # Trajectories were generated under broadcast versions, and the file copy exists.
    turns = rows(engine, "SELECT DISTINCT unnest(turn_versions) FROM trajectories")
    assert {v[0] for v in turns} & {2, 3}, turns
    assert (Path(result.run_dir) / "weights" / "v000004" / "model.safetensors").is_file()
    nothing_lost(db, engine, 4)
    records = (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()
    evals = {r["step"] for r in map(json.loads, records) if r["kind"] == "eval"}
    assert evals == {0, 2, 4}, evals


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_node_lost_mid_broadcast_is_dropped_and_the_others_load_the_version(
    fault: str,
    ray_local: Any,
    tiny_dir: Path,
    db: Database,
    engine: sa.Engine,
    tmp_path: Path,
) -> None:
    flags = tmp_path / "flags"
    flags.mkdir()
    (flags / "arm").touch()
    hook = f"{SUPPORT}:fault:{flags}:{fault}:2:rollout-1"
    incarnations = "SELECT count(*) FROM workers WHERE name = 'rollout-1'"

    def both_members(driver: JobDriver) -> None:
        """Before each publication, hold the job until both nodes are members (at the start,
        and while rollout-1 is restarted after its loss: seconds, where the tiny model's
        steps take one), so that versions go to both: the late joiner's part of the test."""
        wait_for(
            "both nodes members", lambda: len(driver.supervisor.book.members()) == 2, timeout_s=120
        )

    cfg = config(tmp_path, tiny_dir, STEPS)
    result = run_job(cfg, db, tiny_dir, tmp_path, hook, both_members)
    assert result.steps == STEPS
    assert list(flags.glob("armed-*")), "the node was never armed"
    events = broadcasts(engine)
    lost = [e for e in events if e["dropped"]]
    # rollout-1 stopped or died after bucket 2 of the first version: dropped; the group
    # re-formed from rollout-0 alone, which loaded the version. (A stopped node not yet found
    # hung is still a member of the next version's group, and dropped again.)
    assert lost and lost[0]["version"] == 1, events
    for e in lost:
        assert e["dropped"] == ["rollout-1"] and e["loaded"] == ["rollout-0"], e
        assert len(e["epochs"]) == 2, e
    # The restarted rollout-1 (a late joiner) caught up from the files, then took part in
    # the broadcasts again: every later version reached both nodes.
    assert scalar(engine, incarnations) >= 2
    later = events[events.index(lost[-1]) + 1 :]
    assert later, events
    assert all(sorted(e["loaded"]) == ["rollout-0", "rollout-1"] for e in later), events
    last = rows(
        engine,
        "SELECT loaded_version FROM workers WHERE name = 'rollout-1' ORDER BY id DESC LIMIT 1",
    )[0][0]
    assert last == STEPS, last
    nothing_lost(db, engine, STEPS)
