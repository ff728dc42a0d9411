"""Dynamic sampling (``trainer.loss.dynamic_sampling``): a step keeps reserving finished groups
until ``buffer.batch_groups`` of them have different rewards, up to ``max_claims`` extra
claims. The sampler over a real PostgreSQL buffer, rollout played by the test; then jobs on
real Ray with the tiny model: one whose steps train full batches of groups with variance, one
whose task never has any."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml

from rollcall.orchestrator.algorithms import LossConfig
from rollcall.orchestrator.buffer.invariants import check_invariants
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.errors import JobFailedError
from rollcall.orchestrator.runner.dynamic import DynamicSampler
from tests.integration.buffer_helpers import (
    Buffers,
    add_tasks,
    make_buffer,
    payload,
    rows,
    scalar,
)
from tests.integration.test_buffer_trainer import rollout

AGENTS = "tests.support.variance_agents"


def sampler(buf: Buffers, max_claims: int, said: list[str]) -> DynamicSampler:
    loss = LossConfig.model_validate({"dynamic_sampling": {"max_claims": max_claims}})
    return DynamicSampler(loss, 2, buf.trainer, job="default", say=said.append)


def with_variance(engine: sa.Engine, step: int) -> int:
    """Groups consumed by ``step`` whose stored rewards differ."""
    return int(
        scalar(
            engine,
            "SELECT count(*) FROM (SELECT e.id FROM episodes e JOIN trajectories tr "
            "ON tr.task_id = e.task_id AND tr.episode_id = e.id WHERE e.consumed_step = :s "
            "GROUP BY e.id HAVING max(tr.reward) <> min(tr.reward)) g",
            s=step,
        )
    )


def test_a_step_fills_with_groups_with_variance_while_rollout_makes_them(
    db: Database, engine: sa.Engine
) -> None:
    """Sync-mode admission (staleness 0: one batch's worth of groups): the extra claims wait
    for rollout, which goes on because the groups without variance no longer hold the task's
    admission; the enlarged reservation is what a restarted driver replays."""
    a = add_tasks(db, {"name": "a", "group_size": 2, "max_staleness": 0})["a"]
    buf = make_buffer(db, batch_groups=2)
    w = buf.register_worker("r0").id
    varied = lambda i: i % 3 == 2  # noqa: E731  prompts 2 and 5 of 0..5
    rollout(buf, w, 0, varied)
    batch = buf.claim_batch(0, min_groups=2)  # prompts 0 and 1: no variance
    waits: list[int] = []

    def wait(shortfall: int) -> None:
        waits.append(shortfall)
        rollout(buf, w, 0, varied)

    said: list[str] = []
    # a stop requested meanwhile: nothing more is claimed, the reservation stays for --resume
    assert sampler(buf, 8, said).fill(batch, wait=wait, stopped=lambda: True) is None
    assert scalar(engine, "SELECT count(*) FROM episodes WHERE claimed_step = 0") == 2
    filled = sampler(buf, 8, said).fill(batch, wait=wait, stopped=lambda: False)
    assert filled is not None and not said
    # 2 + 2 (prompts 2, 3) + 1 (prompt 4) + 1 (prompt 5): three claims, each of what it lacked
    assert len(filled.groups) == 6 and filled.dynamic_claims == 3
    assert waits == [2, 1, 1]
    assert [g.episode_id for g in filled.groups] == sorted(g.episode_id for g in filled.groups)
    entry = filled.task_mix[str(a)]
    assert (entry["groups"], entry["extra"], entry["degenerate"]) == (6, 4, 4)
    # the driver dies before the commit: its successor replays the same batch, in order
    buf.release_trainer_claims()
    again = make_buffer(db, batch_groups=2).claim_batch(0, min_groups=2)
    assert [g.episode_id for g in again.groups] == [g.episode_id for g in filled.groups]
    assert again.task_mix == filled.task_mix
    # ... and filling it again claims nothing more
    assert sampler(buf, 8, said).fill(again, wait=wait, stopped=lambda: False) == again
    assert buf.commit_step(0).groups == 6 and with_variance(engine, 0) == 2
    assert check_invariants(db, 1).ok


def test_at_the_limit_the_step_trains_what_varies_and_names_the_task_that_never_does(
    db: Database, engine: sa.Engine
) -> None:
    ids = add_tasks(
        db,
        {"name": "flat", "group_size": 2, "max_staleness": 0},
        {"name": "good", "group_size": 2, "max_staleness": 0},
    )
    buf = make_buffer(db, batch_groups=2)
    w = buf.register_worker("r0").id
    varied = {ids["flat"]: False, ids["good"]: True}
    version = 0

    def play() -> None:
        buf.seed()
        while (c := buf.claim(w)) is not None:
            for s in c.samples:
                r = float(s.sample_index) if varied[c.lease.task_id] else 0.0
                buf.commit(c.lease, s.sample_index, payload(version, seed=s.sample_index), r)

    play()
    batch = buf.claim_batch(0, min_groups=2)  # one group of each
    said: list[str] = []
    # the one more group it lacks can only be flat's: good's admission is used
    filled = sampler(buf, 1, said).fill(batch, wait=lambda n: play(), stopped=lambda: False)
    assert filled is not None and len(filled.groups) == 3 and filled.dynamic_claims == 1
    assert said == [
        "step 0 trains 1 group with different rewards, fewer than buffer.batch_groups (2): "
        "dynamic sampling stopped after 1 extra claim "
        "(trainer.loss.dynamic_sampling.max_claims 1); 2 groups with equal rewards are dropped",
        "task flat: 0 of 2 groups claimed for step 0 had different rewards (all rewards 0.0); "
        "dynamic sampling stopped after 1 extra claim: check its reward or raise "
        "trainer.loss.dynamic_sampling.max_claims",
    ]
    message, detail = rows(
        engine, "SELECT message, payload FROM events WHERE kind = 'trainer.dynamic_sampling'"
    )[0]
    assert "task flat: 0 of 2 groups" in message
    assert detail["tasks"]["flat"] == {"groups": 2, "with_variance": 0}

    # a step with no variance at all stops the job, naming the task
    buf.commit_step(0)
    varied[ids["good"]], version = False, 1
    play()
    batch = buf.claim_batch(1, min_groups=2)
    with pytest.raises(JobFailedError) as failed:
        sampler(buf, 1, said).fill(batch, wait=lambda n: play(), stopped=lambda: False)
    assert str(failed.value) == (
        "job 'default' stopped at step 1, which has nothing to train: "
        "task flat: 0 of 2 groups claimed for step 1 had different rewards (all rewards 0.0); "
        "dynamic sampling stopped after 1 extra claim: check its reward or raise "
        "trainer.loss.dynamic_sampling.max_claims; "
        "task good: 0 of 2 groups claimed for step 1 had different rewards (all rewards 0.0); "
        "dynamic sampling stopped after 1 extra claim: check its reward or raise "
        "trainer.loss.dynamic_sampling.max_claims; continue with --resume"
    )
    assert scalar(engine, "SELECT count(*) FROM events WHERE kind = 'job.no_variance'") == 1
    assert check_invariants(db, 1).ok


# --- jobs -------------------------------------------------------------------------------------


def write_config(
    tmp: Path, model: Path, agent: str, *, steps: int, max_claims: int, name: str
) -> Path:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"i": i, "every": 3}) + "\n" for i in range(256)))
    data: dict[str, Any] = {
        "job": {"name": name},
        "model": {"path": str(model)},
        "buffer": {"batch_groups": 2, "lease_s": 30},
        "rollout": {
            "nodes": 1,
            "concurrency": 4,
            "max_tokens_per_turn": 8,
            "max_tokens": 128,
            "heartbeat_interval_s": 0.5,
        },
        "trainer": {
            "lr": 1e-3,
            "micro_batch_tokens": 512,
            "loss": {"dynamic_sampling": {"max_claims": max_claims}},
        },
        "control_plane": {"seed_interval_s": 0.5},
        "run": {"dir": str(tmp / "run"), "total_steps": steps, "eval": {"every": 0, "episodes": 0}},
        "tasks": [
            {
                "name": "bays",
                "agent": agent,
                "prompts": {"path": str(prompts), "held_out_per_mille": 0},
                "max_inflight": 4,
                "max_staleness": 1,
                "spec": {"group_size": 2, "max_turns": 1},
            }
        ],
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.timeout(600)
def test_a_job_trains_full_batches_of_groups_with_variance(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, cli: Any, tmp_path: Path
) -> None:
    config = write_config(
        tmp_path, tiny_dir, f"{AGENTS}:some_vary", steps=2, max_claims=8, name="dyn"
    )
    r = cli("run", str(config), "--no-live")
    print(r.out, r.err)
    assert r.code == 0, r.out + r.err
    assert "job dyn: 2 steps" in r.out
    job = scalar(engine, "SELECT id FROM jobs WHERE name = 'dyn'")
    report = check_invariants(db, job)
    assert report.ok, report.summary()
    steps = rows(engine, "SELECT step, task_mix, metrics FROM train_steps ORDER BY step")
    assert [s for s, _, _ in steps] == [0, 1]
    for step, mix, metrics in steps:
        # every step trained batch_groups groups with variance, and consumed the rest untrained
        assert with_variance(engine, step) == 2
        consumed = scalar(engine, "SELECT count(*) FROM episodes WHERE consumed_step = :s", s=step)
        assert metrics["groups"] == consumed and metrics["groups_filtered"] == consumed - 2
        assert metrics["dynamic_claims"] == mix.get("dynamic_claims", 0)
    # one prompt in three varies: the first batch (the oldest groups) lacked some
    assert sum(m["dynamic_claims"] for _, _, m in steps) >= 1
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["groups"] - r["groups_filtered"] for r in records if r["kind"] == "step"] == [2, 2]


@pytest.mark.timeout(600)
def test_a_job_whose_task_never_varies_stops_naming_it(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, cli: Any, tmp_path: Path
) -> None:
    config = write_config(
        tmp_path, tiny_dir, f"{AGENTS}:constant", steps=3, max_claims=1, name="flat"
    )
    r = cli("run", str(config), "--no-live")
    print(r.out, r.err)
    assert r.code == 7, r.out + r.err
    assert (
        "task bays: 0 of 4 groups claimed for step 0 had different rewards (all rewards 0.0); "
        "dynamic sampling stopped after 1 extra claim: check its reward or raise "
        "trainer.loss.dynamic_sampling.max_claims; continue with --resume"
    ) in r.err, r.err
    assert "Traceback" not in r.out + r.err
    assert scalar(engine, "SELECT status::text FROM jobs WHERE name = 'flat'") == "failed"
    assert scalar(engine, "SELECT count(*) FROM train_steps") == 0
    job = scalar(engine, "SELECT id FROM jobs WHERE name = 'flat'")
    report = check_invariants(db, job)
    assert report.ok, report.summary()
