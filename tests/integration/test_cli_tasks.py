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

from rollcall.orchestrator.db import migrate
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
        ("agent", "agent"),  # the plugin of agent tasks (your own agent function)
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
        ([*reg, "--plugin", "echo", "--weight", "0"], "--weight must be at least 1e-06"),
        ([*reg, "--plugin", "echo", "--weight", "-1"], "--weight must be at least 1e-06"),
        ([*reg, "--plugin", "echo", "--weight", "nan"], "--weight must be a finite number"),
        (
            [*reg, "--plugin", "echo", "--max-inflight", "0"],
            "--max-inflight must be at least 1 and",
        ),
        ([*reg, "--plugin", "echo", "--max-staleness", "-1"], "--max-staleness must be at least 0"),
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
        (["task", "set-quota", "calc", "--weight", "0"], "--weight must be at least 1e-06"),
        (
            ["task", "set-quota", "calc", "--max-inflight", "0"],
            "--max-inflight must be at least 1 and",
        ),
        (
            ["task", "set-quota", "calc", "--max-staleness", "-2"],
            "--max-staleness must be at least 0",
        ),
        (["task", "retire", "calc"], "pass --yes to confirm"),
        (["task", "retire", "ghost", "--yes"], "task 'ghost' does not exist"),
        (["task", "list", "--job", "nojob"], "job 'nojob' does not exist"),
        (["job", "create", "default"], "a job named 'default' already exists"),
        (["job", "create", "Not-Valid"], "is not a valid name"),
        (["job", "show", "nojob"], "job 'nojob' does not exist"),
        (["job", "scale", "nojob", "--rollout-nodes", "2"], "job 'nojob' does not exist"),
        (["job", "scale", "default", "--rollout-nodes", "0"], "--rollout-nodes must be"),
        (["job", "scale", "default", "--rollout-nodes", "2"], "is not running"),
        (["node", "list", "--job", "default"], "has no Ray address recorded"),
        (["node", "drain", "abc", "--job", "nojob"], "job 'nojob' does not exist"),
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


# -- numeric options out of bounds (issue 18, item 14) ----------------------------------------

REG = ["task", "register", "new", "--plugin", "calculator"]
SETQ = ["task", "set-quota", "calc"]
BAD_NUMBERS = [
    ([*REG, "--max-inflight", "99999999999"], "--max-inflight must be"),
    ([*REG, "--max-inflight", "100001"], "--max-inflight must be"),
    ([*REG, "--max-inflight", "0"], "--max-inflight must be"),
    ([*REG, "--max-staleness", "99999999999"], "--max-staleness must be"),
    ([*REG, "--max-staleness", "1001"], "--max-staleness must be"),
    ([*REG, "--max-staleness", "-1"], "--max-staleness must be"),
    ([*REG, "--weight", "1e308"], "--weight must be"),
    ([*REG, "--weight", "1e-320"], "--weight must be"),
    ([*REG, "--weight", "inf"], "--weight must be"),
    ([*REG, "--weight", "nan"], "--weight must be"),
    ([*SETQ, "--max-inflight", "99999999999"], "--max-inflight must be"),
    ([*SETQ, "--max-staleness", "99999999999"], "--max-staleness must be"),
    ([*SETQ, "--weight", "1e308"], "--weight must be"),
    ([*SETQ, "--weight", "-inf"], "--weight must be"),
    (["events", "--limit", "99999999999999999999"], "--limit must be"),
    (["events", "--limit", "-5"], "--limit must be"),
    (["events", "--since", "99999999999d"], "--since"),
    (["status", "--events", "99999999999999999999"], "--events must be"),
    (["status", "--watch", "--interval", "nan"], "--interval must be"),
    (["status", "--watch", "--interval", "1e308"], "--interval must be"),
    (["status", "--watch", "--count", "99999999999999999999"], "--count must be"),
    (["drill", "kill-rollout", "--job", "default", "--yes", "--count", "0"], "--count must be"),
    (["drill", "kill-rollout", "--job", "default", "--yes", "--timeout", "nan"], "--timeout must"),
    (["drill", "kill-trainer", "--job", "default", "--yes", "--timeout", "-1"], "--timeout must"),
    (["drill", "restart-db", "--job", "default", "--yes", "--timeout", "1e308"], "--timeout must"),
    (["drill", "kill-node", "--job", "default", "--yes", "--timeout", "inf"], "--timeout must"),
    (["model", "init", "--out", "OUT", "--hidden", "0"], "--hidden must be"),
    (["model", "init", "--out", "OUT", "--layers", "99999999999"], "--layers must be"),
    (["model", "init", "--out", "OUT", "--heads", "0"], "--heads must be"),
    (["model", "init", "--out", "OUT", "--steps", "-1"], "--steps must be"),
    (["model", "init", "--out", "OUT", "--copy-steps", "99999999999"], "--copy-steps must be"),
    (["model", "init", "--out", "OUT", "--eval-episodes", "-1"], "--eval-episodes must be"),
    (["model", "init", "--out", "OUT", "--seed", "-1"], "--seed must be"),
    (["rollout", "preview", "--task", "echo", "--model", "OUT", "-n", "0"], "-n must be"),
    (["rollout", "preview", "--task", "echo", "--model", "OUT", "--temperature", "0"],
     "--temperature must be"),
    (["rollout", "preview", "--task", "echo", "--model", "OUT", "--temperature", "nan"],
     "--temperature must be"),
    (["rollout", "preview", "--task", "echo", "--model", "OUT", "--max-tokens-per-turn",
      "99999999999"], "--max-tokens-per-turn must be"),
]  # fmt: skip


def test_numeric_options_out_of_bounds_are_one_sentence_and_write_nothing(
    cli: Any, db_url: str, tmp_path: Path
) -> None:
    """One database for all the cases (a fresh one each would cost minutes): every refusal is
    checked, and the ones that fail are listed together."""
    _register(cli)
    out = tmp_path / "out"
    failures = []
    for args, message in BAD_NUMBERS:
        args = [str(out) if a == "OUT" else a for a in args]
        try:
            with unchanged(db_url):
                r = cli(*args)
        except Exception as e:  # a traceback (or a write) instead of a refusal
            failures.append((args, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"))
            continue
        ok = (
            r.code == 2
            and "Traceback" not in r.err + r.out
            and r.err.startswith("error: ")
            and message in r.err
            and len(r.err.strip().splitlines()) <= 3  # one sentence (wrapped at most)
            and not out.exists()
        )
        if not ok:
            failures.append((args, f"exit {r.code}: {(r.err or r.out).strip()[:160]}"))
    assert not failures, "\n".join(f"{' '.join(a)} -> {why}" for a, why in failures)


def test_numeric_options_at_their_bounds_are_accepted(cli: Any) -> None:
    _register(cli, "low", "--weight", "1e-6", "--max-inflight", "100000", "--max-staleness", "0")
    _register(cli, "high", "--weight", "1e6", "--max-inflight", "1", "--max-staleness", "1000")
    assert cli("task", "set-quota", "low", "--weight", "1e6").code == 0
    assert cli("events", "--limit", "1").code == 0


# -- quota changes that would stall the running job (issue 18, item 10) -----------------------


def _job_with_config(db: Any, **config: Any) -> None:
    from rollcall.orchestrator.config import RollcallConfig
    from rollcall.orchestrator.services.jobs import create_job

    cfg = RollcallConfig.model_validate({"job": {"name": "tight"}, **config})
    with db.transaction() as tx:
        create_job(tx, "tight", config=cfg.model_dump(mode="json"), actor="test")


def test_quota_changes_that_would_leave_the_batch_unfillable_are_refused(
    cli: Any, db: Any, db_url: str
) -> None:
    # weights published every 4 steps: the last step before each publication trains only data
    # at most 3 versions old, so tasks with max_staleness >= 3 must be able to fill the batch
    _job_with_config(db, buffer={"batch_groups": 8}, trainer={"sync_every": 4})
    job = ["--job", "tight"]
    assert cli("task", "register", "a", "--plugin", "echo", "--max-staleness", "3", *job).code == 0
    refused = [
        (["task", "set-quota", "a", "--max-staleness", "2", *job], "at least 3"),
        (["task", "register", "b", "--plugin", "echo", "--weight", "7", "--max-staleness", "0",
          *job], "at most 4 groups"),
    ]  # fmt: skip
    for args, message in refused:
        with unchanged(db_url):
            r = cli(*args)
        assert r.code == 4, (args, r.out, r.err)  # a conflict with the job's config
        assert r.err.startswith("error: ") and "buffer.batch_groups (8)" in r.err, r.err
        assert message in r.err and "Traceback" not in r.err, r.err
    # a stale-intolerant task beside one that can fill the batch alone is fine
    r = cli("task", "register", "b", "--plugin", "echo", "--max-staleness", "0", *job)
    assert r.code == 0, r.err
    assert cli("task", "set-quota", "a", "--max-staleness", "5", *job).code == 0
    # a job without a config (created by `job create`) has no batch to check against
    _register(cli, "calc", "--max-staleness", "0", "--weight", "1e6")
    assert cli("task", "set-quota", "calc", "--max-staleness", "1000").code == 0


def test_a_run_whose_config_the_jobs_other_tasks_would_stall_is_refused(
    cli: Any, db: Any, db_url: str
) -> None:
    # registered from the command line while the job published after every step
    from rollcall.orchestrator.config import TaskConfig
    from rollcall.orchestrator.errors import ConflictError
    from rollcall.orchestrator.quotas import BatchPolicy
    from rollcall.orchestrator.services.tasks import ensure_tasks

    _job_with_config(db, buffer={"batch_groups": 8})
    job = ["--job", "tight"]
    assert cli("task", "register", "b", "--plugin", "echo", "--weight", "7",
               "--max-staleness", "0", *job).code == 0  # fmt: skip
    tasks = [TaskConfig(name="a", plugin="echo", max_staleness=3)]
    every_4 = BatchPolicy(8, sync_every=4)  # now run with weights published every 4 steps
    with (
        unchanged(db_url),
        pytest.raises(ConflictError, match=r"at most 4 groups"),
        db.transaction() as tx,
    ):
        ensure_tasks(tx, job_name="tight", tasks=tasks, actor="test", policy=every_4)
    with db.transaction() as tx:  # every step, as before: fine
        ensure_tasks(tx, job_name="tight", tasks=tasks, actor="test", policy=BatchPolicy(8, 1))
