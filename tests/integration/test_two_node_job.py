"""A job across two Ray nodes on one machine (``ray.cluster_utils.Cluster``): the head hosts the
driver, the trainer (``trainer.resources: {trainer: 1}``) and the evaluator; the rollout nodes
need ``{rollout: 1}``, which only the second node advertises, so they run there. The job runs as
the runtime role of ``ops/deploy/postgres-roles.sql`` (migrated by the migration role), which
shows that role is enough for a whole job: driver, rollout nodes and trainer ranks."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import SecretStr

from rollcall.orchestrator.buffer.invariants import check_invariants
from rollcall.orchestrator.config import DatabaseConfig
from rollcall.orchestrator.db.engine import open_database
from tests.chaos.test_faults import _config, _driver
from tests.conftest import PgServer, init_local_ray
from tests.integration.buffer_helpers import rows
from tests.integration.roles import (
    MIGRATOR_PASSWORD,
    RUNTIME,
    RUNTIME_PASSWORD,
    create_role_database,
    migrate_as_migrator,
)

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
_n = itertools.count()


@pytest.fixture
def two_nodes() -> Iterator[tuple[Any, Any]]:
    """A head node (4 CPUs, ``{trainer: 1}``) and a worker node (2 CPUs, ``{rollout: 2}``);
    the session's local Ray, if there was one, comes back afterwards."""
    import ray
    from ray.cluster_utils import Cluster

    had_local = ray.is_initialized()
    ray.shutdown()
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 4, "resources": {"trainer": 1}}
    )
    try:
        worker = cluster.add_node(num_cpus=2, resources={"rollout": 2})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        yield cluster, worker
    finally:
        ray.shutdown()
        cluster.shutdown()
        os.environ.pop("RAY_ADDRESS", None)
        if had_local:
            init_local_ray()


def test_job_on_two_ray_nodes_as_the_runtime_role(
    pg: PgServer,
    two_nodes: tuple[Any, Any],
    tiny_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cluster, worker = two_nodes
    rdb = create_role_database(pg, f"t_twonode_{os.getpid()}_{next(_n)}")
    migrate_as_migrator(rdb)
    cfg = _config(tmp_path, tiny_dir, steps=3, resources={"rollout": 1}, start_timeout_s=90.0)
    cfg = cfg.model_copy(
        update={
            "trainer": cfg.trainer.model_copy(update={"resources": {"trainer": 1}}),
            # as a production config would say it: the run directory and the job row keep it
            "database": DatabaseConfig(url=SecretStr(rdb.runtime_url)),
        }
    )
    db = open_database(rdb.runtime_url)
    users: set[str] = set()

    def sample_connections(_driver: Any) -> None:
        # mid-step, with every component connected: who is connected as rollcall?
        with db.transaction() as tx:
            users.update(
                tx.session.execute(
                    sa.text(
                        "SELECT DISTINCT usename FROM pg_stat_activity "
                        "WHERE datname = current_database() AND application_name = 'rollcall'"
                    )
                ).scalars()
            )

    driver = _driver(cfg, db, tiny_dir, tmp_path)
    driver.fault_hooks["after_train"] = sample_connections
    try:
        driver.setup()
        result = driver.run()
    finally:
        driver.close()
    assert result.steps == 3
    assert users == {RUNTIME}  # the driver, the rollout nodes and the trainer rank

    engine = sa.create_engine(rdb.runtime_url, poolclass=sa.pool.NullPool)
    try:
        placed = rows(engine, "SELECT role::text, node_id FROM workers")
        stored_config = rows(engine, "SELECT config::text FROM jobs WHERE name = 'chaos'")[0][0]
    finally:
        engine.dispose()
    head = cluster.head_node.node_id
    assert {n for r, n in placed if r == "rollout"} == {worker.node_id}
    assert {n for r, n in placed if r == "trainer"} == {head}
    assert sum(1 for r, _ in placed if r == "rollout") >= 2  # both slots
    report = check_invariants(db, driver.job_id)
    db.dispose()
    assert report.ok, report.summary()
    out = capsys.readouterr()
    assert RUNTIME_PASSWORD not in out.out + out.err
    assert MIGRATOR_PASSWORD not in out.out + out.err
    written = (Path(result.run_dir) / "config.yaml").read_text()
    assert "url: '**********'" in written and RUNTIME_PASSWORD not in written
    assert RUNTIME_PASSWORD not in stored_config
