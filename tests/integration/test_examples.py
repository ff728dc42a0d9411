"""Every example in ``examples/`` runs as a job (``rollcall run examples/X/config.yaml``), on
the tiny model with real Ray, PostgreSQL and the ``hf`` engine: a few steps, a held-out
evaluation at the start and the end, nothing quarantined, the invariants holding.

The four examples' configs differ only in the job's name and their task (checked below), so one
job runs them all: each example's config is loaded as ``rollcall run`` loads it, and its task
(named after the example) is one of the job's four; each is asserted on per task."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from rollcall.orchestrator.buffer.invariants import check_invariants
from rollcall.orchestrator.config import RollcallConfig, load_config
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.runner.driver import RunResult
from tests.chaos.test_faults import _driver
from tests.integration.buffer_helpers import rows, scalar

pytestmark = pytest.mark.timeout(600)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NAMES = sorted(p.parent.name for p in EXAMPLES.glob("*/config.yaml"))
STEPS = 2
EVAL_EPISODES = 2
GROUP_SIZE = 2  # the examples' 8: a group of each of the four tasks is 8 episodes


def test_the_examples_are_the_four_the_manual_lists() -> None:
    assert NAMES == ["judge", "lookup", "openai_client", "openrlhf"]


@dataclass
class ExamplesJob:
    configs: dict[str, RollcallConfig]  # each example's own, as loaded
    result: RunResult
    db: Database
    engine: sa.Engine
    job_id: int
    run_dir: Path
    log_path: Path  # the driver's log


def _load(name: str, tiny_dir: Path, run_dir: Path) -> RollcallConfig:
    return load_config(
        EXAMPLES / name / "config.yaml",
        [
            f"model.path={tiny_dir}",
            f"run.dir={run_dir}",
            f"run.total_steps={STEPS}",
            "run.eval.every=0",
            f"run.eval.episodes={EVAL_EPISODES}",
            "rollout.concurrency=4",
            "buffer.batch_groups=4",  # a group of each task per step, when all have one
        ],
    )


@pytest.fixture(scope="module")
def examples_job(
    ray_local: Any, tiny_dir: Path, pg: Any, template_url: str, tmp_path_factory: Any
) -> Iterator[ExamplesJob]:
    """One job with the four examples' tasks, each loaded from its example's config."""
    from tests.conftest import job_database

    tmp = tmp_path_factory.mktemp("examples")
    configs = {name: _load(name, tiny_dir, tmp / "run") for name in NAMES}
    base = configs[NAMES[0]]
    tasks = [
        t.model_copy(update={"name": n, "spec": {**t.spec, "group_size": GROUP_SIZE}})
        for n, t in ((n, configs[n].tasks[0]) for n in NAMES)
    ]
    cfg = base.model_copy(
        update={"job": base.job.model_copy(update={"name": "examples"}), "tasks": tasks}
    )
    with job_database(pg, "examples") as (_, db, engine):
        driver = _driver(cfg, db, tiny_dir, tmp)
        try:
            driver.setup()
            result = driver.run()
        finally:
            driver.close()
        job_id = scalar(engine, "SELECT id FROM jobs WHERE name = 'examples'")
        yield ExamplesJob(configs, result, db, engine, job_id, tmp / "run", driver.run_dir.log_path)


@pytest.mark.timeout(900)  # sets the job up: a run of the four examples
def test_the_examples_configs_differ_only_in_their_job_and_task(examples_job: ExamplesJob) -> None:
    """What makes one job a run of each example: the rest of each config is the same."""
    rest = {
        name: cfg.model_dump(mode="json", exclude={"job", "tasks"})
        for name, cfg in examples_job.configs.items()
    }
    first = rest[NAMES[0]]
    assert all(r == first for r in rest.values()), rest
    assert all(len(cfg.tasks) == 1 for cfg in examples_job.configs.values())


def test_the_job_of_the_examples_trains_and_keeps_its_invariants(
    examples_job: ExamplesJob,
) -> None:
    job = examples_job
    assert job.result.steps == STEPS
    report = check_invariants(job.db, job.job_id)
    assert report.ok, report.summary()
    assert scalar(job.engine, "SELECT count(*) FROM episodes WHERE status = 'quarantined'") == 0
    evals = (job.run_dir / "metrics.jsonl").read_text().count('"kind": "eval"')
    log = job.log_path.read_text().splitlines() if job.log_path.exists() else []
    said = "\n".join(line for line in log if "evaluat" in line)
    assert evals >= 2, f"the held-out evaluation did not run at the start and the end: {said}"


@pytest.mark.parametrize("name", NAMES)
def test_an_example_runs_as_a_job(name: str, examples_job: ExamplesJob) -> None:
    """The example's task: its agent finished episodes with trajectories, none quarantined,
    and the held-out evaluation ran it at the start and at the end."""
    job = examples_job
    task = job.configs[name].tasks[0]
    assert task.agent is not None and task.agent.startswith(str(EXAMPLES / name))
    done = rows(
        job.engine,
        """SELECT e.status::text, count(*) FROM episodes e JOIN tasks t ON t.id = e.task_id
           WHERE t.name = :n GROUP BY 1""",
        n=name,
    )
    states = dict(done)
    assert states.get("done", 0) > 0, states
    assert states.get("quarantined", 0) == 0, states
    trajectories = scalar(
        job.engine,
        """SELECT count(*) FROM trajectories tr JOIN episodes e ON e.id = tr.episode_id
           JOIN tasks t ON t.id = e.task_id WHERE t.name = :n""",
        n=name,
    )
    assert trajectories > 0
    evals = _evals(job)
    assert [r["step"] for r in evals][:1] == [0] and evals[-1]["step"] == STEPS, evals
    for r in (evals[0], evals[-1]):
        assert len(r["rewards"][name]) == EVAL_EPISODES, r


def _evals(job: ExamplesJob) -> list[dict[str, Any]]:
    import json

    records = (job.run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, records) if r["kind"] == "eval"]
