"""Every task/job/db command of the CLI against a real PostgreSQL, including bad input.

Each refused command must exit non-zero with one clear sentence and leave the database exactly
as it was (``unchanged`` compares every row of every table and the list of relations).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator.db import migrate
from tests.conftest import unchanged


def _events(engine: sa.Engine) -> list[tuple[str, str]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT kind, actor FROM events ORDER BY id"))
        return [(r[0], r[1]) for r in rows]


def _register(cli: Any, name: str = "calc", *extra: str) -> Any:
    r = cli("task", "register", name, "--plugin", "echo", *extra)
    assert r.code == 0, r.err
    return r


def test_register_list_show(cli: Any, engine: sa.Engine, tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("group_size: 8\nwords: [a, b]\n")
    r = _register(
        cli,
        "calc",
        "--weight",
        "2.5",
        "--max-inflight",
        "3",
        "--max-staleness",
        "0",
        "--spec",
        str(spec),
    )
    assert "Registered task 'calc'" in r.out and "trajectories_t1" in r.out

    r = cli("task", "list", "--json")
    assert r.code == 0
    (row,) = json.loads(r.out)
    assert row["name"] == "calc" and row["plugin"] == "echo" and row["status"] == "active"
    assert (row["weight"], row["max_inflight"], row["max_staleness"]) == (2.5, 3, 0)
    assert row["spec"]["group_size"] == 8 and row["spec"]["words"] == ["a", "b"]
    assert row["spec"]["max_length"] == 4  # defaults filled in

    r = cli("task", "show", "calc", "--json")
    data = json.loads(r.out)
    assert data["partition_attached"] is True
    assert data["episodes"] == {} and data["trajectories"] == {}
    assert [e["kind"] for e in data["recent_events"]] == ["task.registered"]

    r = cli("task", "list")
    assert r.code == 0 and "calc" in r.out and "echo" in r.out
    r = cli("task", "show", "calc")
    assert r.code == 0 and "attached" in r.out

    assert _events(engine)[-1][0] == "task.registered"
    assert _events(engine)[-1][1].startswith("operator:")


def test_plugins(cli: Any) -> None:
    r = cli("task", "plugins", "--json")
    assert r.code == 0
    rows = json.loads(r.out)
    assert [(p["name"], p["source"]) for p in rows] == [
        ("calculator", "builtin"), ("echo", "builtin"), ("guess", "builtin"),
        ("longtail", "benchmark"),  # the pipeline benchmark's timing model, listed as such
        ("retrieval", "builtin"),
    ]  # fmt: skip
    assert "group_size" in rows[0]["spec_schema"]["properties"]
    r = cli("task", "plugins")
    assert r.code == 0 and "echo" in r.out and "builtin" in r.out


def test_status_transitions_write_events(cli: Any, engine: sa.Engine) -> None:
    _register(cli)
    steps = [
        ("pause", "paused", "task.paused"),
        ("drain", "draining", "task.draining"),
        ("resume", "active", "task.resumed"),
        ("drain", "draining", "task.draining"),
        ("pause", "paused", "task.paused"),
        ("resume", "active", "task.resumed"),
    ]
    for action, status, kind in steps:
        r = cli("task", action, "calc")
        assert r.code == 0, r.err
        assert f"now {status}" in r.out
        assert _events(engine)[-1][0] == kind
        assert json.loads(cli("task", "show", "calc", "--json").out)["status"] == status


def test_repeated_transition_is_a_noop(cli: Any, db_url: str) -> None:
    _register(cli)
    assert cli("task", "pause", "calc").code == 0
    with unchanged(db_url):
        r = cli("task", "pause", "calc")
    assert r.code == 0 and "already paused" in r.out


def test_set_quota(cli: Any, engine: sa.Engine) -> None:
    _register(cli)
    r = cli("task", "set-quota", "calc", "--weight", "4", "--max-inflight", "2")
    assert r.code == 0, r.err
    data = json.loads(cli("task", "show", "calc", "--json").out)
    assert (data["weight"], data["max_inflight"], data["max_staleness"]) == (4.0, 2, 2)
    with engine.connect() as conn:
        payload = conn.scalar(
            sa.text("SELECT payload FROM events WHERE kind = 'task.quota_changed'")
        )
    assert payload == {
        "before": {"weight": 1.0, "max_inflight": 8, "max_staleness": 2},
        "after": {"weight": 4.0, "max_inflight": 2, "max_staleness": 2},
    }


def test_retire(cli: Any, engine: sa.Engine) -> None:
    _register(cli)
    r = cli("task", "retire", "calc", "--yes")
    assert r.code == 0, r.err
    data = json.loads(cli("task", "show", "calc", "--json").out)
    assert data["status"] == "retired" and data["partition_attached"] is False
    assert _events(engine)[-1][0] == "task.retired"
    # The name is free again; a new task gets a new partition.
    r = _register(cli)
    assert "trajectories_t2" in r.out


def test_retire_refused_while_work_is_outstanding(cli: Any, engine: sa.Engine, db_url: str) -> None:
    _register(cli)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO episodes (job_id, task_id, prompt_index, prompt, group_size) VALUES (1, 1, 0, '{}', 4)"
            )
        )
    with unchanged(db_url):
        r = cli("task", "retire", "calc", "--yes")
    assert r.code != 0
    assert "1 queued or leased episodes" in r.err and "rollcall task drain calc" in r.err


def test_jobs(cli: Any, engine: sa.Engine) -> None:
    r = cli("job", "create", "exp1")
    assert r.code == 0, r.err
    jobs = json.loads(cli("job", "list", "--json").out)
    assert [j["name"] for j in jobs] == ["default", "exp1"]
    _register(cli, "calc", "--job", "exp1")
    _register(cli, "calc")  # same name in another job is fine
    data = json.loads(cli("job", "show", "exp1", "--json").out)
    assert [t["name"] for t in data["tasks"]] == ["calc"]
    assert [e["kind"] for e in data["recent_events"]] == ["job.created", "task.registered"]
    assert cli("job", "list").code == 0
    assert "exp1" in cli("job", "show", "exp1").out
    assert json.loads(cli("task", "list", "--json", "--job", "exp1").out)[0]["job"] == "exp1"


def test_job_env_var_selects_job(cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli("job", "create", "exp2").code == 0
    monkeypatch.setenv("ROLLCALL_JOB", "exp2")
    _register(cli)
    assert json.loads(cli("task", "list", "--json").out)[0]["job"] == "exp2"


def _bad_inputs(tmp: Path) -> list[tuple[list[str], str]]:
    malformed = tmp / "malformed.yaml"
    malformed.write_text("group_size: [4\n")
    violating = tmp / "violating.yaml"
    violating.write_text("group_size: 0\n")
    unknown_key = tmp / "unknown.yaml"
    unknown_key.write_text("group_sise: 4\n")
    not_mapping = tmp / "list.yaml"
    not_mapping.write_text("- 1\n- 2\n")
    missing = tmp / "missing.yaml"
    reg = ["task", "register", "new"]
    return [
        ([*reg, "--plugin", "nope"], "unknown task plugin 'nope'"),
        ([*reg, "--plugin", "tasks/echo.py"], "unknown task plugin"),
        ([*reg, "--plugin", "echo", "--weight", "0"], "--weight must be greater than 0"),
        ([*reg, "--plugin", "echo", "--weight", "-1"], "--weight must be greater than 0"),
        ([*reg, "--plugin", "echo", "--weight", "nan"], "--weight must be greater than 0"),
        ([*reg, "--plugin", "echo", "--max-inflight", "0"], "--max-inflight must be at least 1"),
        ([*reg, "--plugin", "echo", "--max-staleness", "-1"], "--max-staleness must be 0 or more"),
        ([*reg, "--plugin", "echo", "--spec", str(malformed)], "is not valid YAML at line"),
        (
            [*reg, "--plugin", "echo", "--spec", str(violating)],
            "group_size: Input should be greater than or equal to 1",
        ),
        ([*reg, "--plugin", "echo", "--spec", str(unknown_key)], "group_sise: unknown key"),
        ([*reg, "--plugin", "echo", "--spec", str(not_mapping)], "must hold a mapping"),
        ([*reg, "--plugin", "echo", "--spec", str(missing)], "does not exist"),
        ([*reg, "--plugin", "echo", "--job", "nojob"], "job 'nojob' does not exist"),
        (["task", "register", "Bad Name", "--plugin", "echo"], "is not a valid name"),
        (["task", "register", "calc", "--plugin", "echo"], "a task named 'calc' already exists"),
        (["task", "show", "ghost"], "task 'ghost' does not exist"),
        (["task", "pause", "ghost"], "task 'ghost' does not exist"),
        (["task", "resume", "ghost"], "task 'ghost' does not exist"),
        (["task", "drain", "ghost"], "task 'ghost' does not exist"),
        (["task", "set-quota", "ghost", "--weight", "2"], "task 'ghost' does not exist"),
        (["task", "set-quota", "calc"], "needs at least one of --weight"),
        (["task", "set-quota", "calc", "--weight", "0"], "--weight must be greater than 0"),
        (["task", "set-quota", "calc", "--max-inflight", "0"], "--max-inflight must be at least 1"),
        (
            ["task", "set-quota", "calc", "--max-staleness", "-2"],
            "--max-staleness must be 0 or more",
        ),
        (["task", "retire", "calc"], "pass --yes to confirm"),
        (["task", "retire", "ghost", "--yes"], "task 'ghost' does not exist"),
        (["task", "list", "--job", "nojob"], "job 'nojob' does not exist"),
        (["job", "create", "default"], "a job named 'default' already exists"),
        (["job", "create", "Not-Valid"], "is not a valid name"),
        (["job", "show", "nojob"], "job 'nojob' does not exist"),
    ]


def test_bad_input_is_refused_and_writes_nothing(cli: Any, db_url: str, tmp_path: Path) -> None:
    _register(cli)
    for args, message in _bad_inputs(tmp_path):
        with unchanged(db_url):
            r = cli(*args)
        assert r.code != 0, args
        assert message in r.err, (args, r.err)
        assert r.err.startswith("error: "), (args, r.err)
        assert "Traceback" not in r.err
        assert len(r.err.strip().splitlines()) <= 3, r.err  # one sentence (wrapped at most)


def test_actions_on_a_retired_task_are_refused(cli: Any, db_url: str) -> None:
    _register(cli)
    assert cli("task", "retire", "calc", "--yes").code == 0
    for args in (
        ["task", "pause", "calc"],
        ["task", "resume", "calc"],
        ["task", "drain", "calc"],
        ["task", "set-quota", "calc", "--weight", "2"],
        ["task", "retire", "calc", "--yes"],
    ):
        with unchanged(db_url):
            r = cli(*args)
        assert r.code != 0, args
        assert "retired" in r.err, (args, r.err)


def test_commands_refuse_a_schema_behind_head(
    empty_db_url: str, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.conftest import make_cli_runner

    monkeypatch.setenv("ROLLCALL_DATABASE_URL", empty_db_url)
    run = make_cli_runner(capsys)
    for args in (
        ["task", "list"],
        ["task", "register", "a", "--plugin", "echo"],
        ["job", "list"],
        ["db", "check"],
    ):
        with unchanged_empty(empty_db_url):
            r = run(*args)
        assert r.code != 0, args
        assert "run `rollcall db upgrade`" in r.err, (args, r.err)
    r = run("db", "current", "--json")
    assert r.code == 0 and json.loads(r.out)["current"] is None
    r = run("db", "upgrade")
    assert r.code == 0 and f"upgraded from empty to {migrate.head_revision()}" in r.out
    r = run("db", "upgrade")
    assert r.code == 0 and "already at head" in r.out
    r = run("db", "check")
    assert r.code == 0, r.err
    r = run("db", "current", "--json")
    assert json.loads(r.out)["at_head"] is True
    assert run("task", "list").code == 0


def unchanged_empty(url: str) -> Any:
    """For a database without tables: compare the relations only."""
    import contextlib

    @contextlib.contextmanager
    def cm() -> Any:
        eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
        q = sa.text(
            "SELECT relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public'"
        )
        with eng.connect() as conn:
            before = sorted(conn.scalars(q))
        yield
        with eng.connect() as conn:
            after = sorted(conn.scalars(q))
        eng.dispose()
        assert after == before

    return cm()


def test_db_check_reports_drift(cli: Any, engine: sa.Engine) -> None:
    assert cli("db", "check").code == 0
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE tasks ADD COLUMN surprise integer"))
    r = cli("db", "check")
    assert r.code != 0
    assert "surprise" in r.err and "differs from the models" in r.err


def test_password_is_never_printed(capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.conftest import make_cli_runner

    monkeypatch.setenv("ROLLCALL_DATABASE_URL", "postgresql://rc:hunter2secret@127.0.0.1:9/rc")
    run = make_cli_runner(capsys)
    for args in (["task", "list"], ["db", "current"], ["db", "status"], ["db", "stop"]):
        r = run(*args)
        assert "hunter2secret" not in r.out + r.err, args
        assert r.code != 0 or args == ["db", "status"]
    r = run("db", "status")
    assert "rc:***@127.0.0.1:9/rc" in r.out
    r = run("task", "list")
    assert "cannot connect to the database at postgresql+psycopg://rc:***@127.0.0.1:9/rc" in r.err


def test_unchanged_detects_a_write(cli: Any, db_url: str) -> None:
    # The guard used above must be able to fail: a real write trips it.
    with pytest.raises(AssertionError), unchanged(db_url):
        _register(cli, "written")


def test_drills_refuse_without_yes(cli: Any, db_url: str) -> None:
    for drill in ("kill-rollout", "kill-trainer", "restart-db", "kill-node"):
        with unchanged(db_url):
            r = cli("drill", drill, "--job", "default")
        assert r.code == 2, (drill, r.out, r.err)
        assert "pass --yes to confirm" in r.err and r.err.count("\n") == 1
