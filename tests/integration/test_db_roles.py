"""The two roles of ``ops/deploy/postgres-roles.sql`` on a real PostgreSQL: the migration role
runs ``rollcall db upgrade``; the runtime role does everything a job and the operator CLI do
(task registration with its partition, seeding, claims, checkpoints, commits, batch claims,
step commits, sweeps, retirement) and is refused every kind of DDL. The same statements run as
the migration role succeed, so each refusal is about the role, not the statement."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from rollcall.orchestrator.buffer.invariants import check_invariants
from rollcall.orchestrator.db.engine import open_database
from rollcall.orchestrator.domain import WorkerStatus
from tests.conftest import PgServer, make_cli_runner
from tests.integration.buffer_helpers import add_tasks, drain_queue, make_buffer, payload
from tests.integration.roles import (
    MIGRATOR,
    MIGRATOR_PASSWORD,
    RUNTIME,
    RUNTIME_PASSWORD,
    RoleDatabase,
    create_role_database,
)

_n = itertools.count()

# DDL (and the two writes rollcall never needs) that the runtime role must be refused
REFUSED = [
    "CREATE TABLE rogue (id integer)",
    "CREATE TEMP TABLE rogue (id integer)",
    "CREATE SCHEMA rogue",
    "CREATE INDEX rogue ON tasks (name)",
    "CREATE FUNCTION rogue() RETURNS integer LANGUAGE sql AS 'SELECT 1'",
    "CREATE VIEW rogue AS SELECT 1 AS x",
    "ALTER TABLE tasks ADD COLUMN rogue integer",
    "ALTER TABLE trajectories DETACH PARTITION {partition}",
    "DROP TABLE events",
    "DROP TABLE {partition}",
    "TRUNCATE events",
    "DELETE FROM train_steps",
    "DELETE FROM events",  # the audit log: pruned only by its retention rule
    "DELETE FROM trajectories",  # metadata: compacted only by its retention rule
    "DELETE FROM compacted_steps",
]


@pytest.fixture
def rdb(pg: PgServer) -> Iterator[RoleDatabase]:
    name = f"t_roles_{os.getpid()}_{next(_n)}"
    yield create_role_database(pg, name)
    pg.drop_database(name)


def _runner(capsys: Any, monkeypatch: pytest.MonkeyPatch, url: str) -> Any:
    monkeypatch.setenv("ROLLCALL_DATABASE_URL", url)
    monkeypatch.delenv("ROLLCALL_JOB", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    run = make_cli_runner(capsys)

    def checked(*args: str) -> Any:
        r = run(*args)
        assert MIGRATOR_PASSWORD not in r.out + r.err and RUNTIME_PASSWORD not in r.out + r.err
        return r

    return checked


def _admin(pg: PgServer, rdb: RoleDatabase) -> psycopg.Connection[Any]:
    return psycopg.connect(
        host=str(pg.socket_dir), port=5432, user="postgres", dbname=rdb.name, autocommit=True
    )


def test_runtime_role_runs_a_job_s_database_work_and_is_refused_ddl(
    pg: PgServer, rdb: RoleDatabase, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 1. the migration role migrates (the only DDL), and owns everything it created
    r = _runner(capsys, monkeypatch, rdb.migrator_url)("db", "upgrade")
    assert r.code == 0, r.err
    assert "Schema upgraded from empty to" in r.out and f"{MIGRATOR}:***@" in r.out
    with _admin(pg, rdb) as conn:
        owners = {
            row[0]
            for row in conn.execute(
                "SELECT tableowner FROM pg_tables WHERE schemaname = 'public' UNION "
                "SELECT pg_get_userbyid(proowner) FROM pg_proc "
                "WHERE pronamespace = 'public'::regnamespace"
            )
        }
        assert owners == {MIGRATOR}
        # rollcall's functions are executable by the runtime role, not by PUBLIC
        acls = dict(
            conn.execute(
                "SELECT proname, proacl::text FROM pg_proc "
                "WHERE pronamespace = 'public'::regnamespace AND proname LIKE 'rollcall_%'"
            ).fetchall()
        )
    assert {"rollcall_attach_task_partition", "rollcall_detach_task_partition"} <= set(acls)
    for name, acl in acls.items():
        entries = acl.strip("{}").split(",")
        assert f"{RUNTIME}=X/{MIGRATOR}" in entries, (name, acl)
        assert not any(e.startswith("=") for e in entries), (name, acl)  # PUBLIC

    # 2. the runtime role: the operator CLI (registration creates the partition through the
    # SECURITY DEFINER function; retirement detaches one)
    cli = _runner(capsys, monkeypatch, rdb.runtime_url)
    assert cli("db", "check").code == 0
    assert cli("job", "create", "other").code == 0
    assert cli("task", "register", "spare", "--plugin", "echo").code == 0
    assert cli("task", "retire", "spare", "--yes").code == 0

    # 3. ... and everything a job does to the buffer
    db = open_database(rdb.runtime_url)
    try:
        with db.transaction() as tx:
            assert tx.session.execute(sa.text("SELECT current_user")).scalar() == RUNTIME
        ids = add_tasks(db, {"name": "a", "max_staleness": 1}, {"name": "b", "max_staleness": 1})
        buf = make_buffer(db, batch_groups=2, payload_retention_steps=0, metadata_retention_steps=0)
        assert sum(buf.seed().values()) > 0
        w = buf.register_worker("rollout-0", host="h", pid=1)
        claim = buf.claim(w.id)
        assert claim is not None
        buf.checkpoint(claim.lease, 0, payload(0, turns=1))
        buf.checkpoint(claim.lease, 0, payload(0, turns=1, seed=1))  # replaces the segment
        buf.beat(w.id, tokens_generated=8, loaded_version=0)
        buf.release(claim.lease, "the rollout failed")  # requeued, resumed below
        assert len(drain_queue(buf, w.id, version=0)) >= 2
        batch = buf.claim_batch(0, min_groups=2)
        assert len(batch.groups) == 2
        commit = buf.commit_step(0, checkpoint_uri="file:///c/0", metrics={"train_s": 0.1})
        assert commit.policy_version == 1
        assert buf.drop_old_payloads()[0] == batch.num_trajectories  # retention deletes
        with _admin(pg, rdb) as conn:  # three events of the job two days old
            conn.execute(
                "INSERT INTO events (job_id, kind, actor, message, created_at) SELECT %s, "
                "'test.old', 'test', 'e', now() - interval '2 days' FROM generate_series(1, 3)",
                (buf.job_id,),
            )
        # and ages the audit log out (through rollcall_drop_old_events: it has no DELETE on
        # events), the newest of a kind kept
        assert buf.drop_old_events(3_600.0, 1_000) == 2
        # and compacts the metadata of old steps (through rollcall_compact_steps: it has no
        # DELETE on episodes or trajectories): step 0's two groups
        assert buf.compact_metadata(min_age_s=0) == 2
        buf.expire_stale()
        buf.sweep_expired_leases()
        buf.sweep_dead_workers(10.0, 30.0)
        trainer = buf.register_worker("trainer-0", host="h", pid=2)
        buf.requeue_worker(trainer.id, WorkerStatus.STOPPED)
        assert check_invariants(db, 1).ok
    finally:
        db.dispose()
    r = cli("status", "--job", "default", "--json")
    assert r.code == 0, r.err
    assert {t["name"] for t in json.loads(r.out)["tasks"]} == set(ids)

    # 4. no DDL for the runtime role; the migration role may (so the statements are valid)
    statements = [sql.format(partition=f"trajectories_t{ids['a']}") for sql in REFUSED]
    for sql in statements:
        with (
            psycopg.connect(**rdb.conninfo(RUNTIME), autocommit=True) as conn,
            pytest.raises(psycopg.errors.InsufficientPrivilege),
        ):
            conn.execute(sql)
    with psycopg.connect(**rdb.conninfo(MIGRATOR)) as conn:
        for sql in statements:
            conn.execute("SAVEPOINT s")
            conn.execute(sql)
            conn.execute("ROLLBACK TO SAVEPOINT s")
        conn.rollback()
    with _admin(pg, rdb) as conn:
        assert conn.execute("SELECT to_regclass('rogue')").fetchone() == (None,)
        assert conn.execute("SELECT count(*) FROM events").fetchone()[0] > 0  # type: ignore[index]
