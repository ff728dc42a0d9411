"""The embedded PostgreSQL: start, reuse, stop, restart, survival of killed processes, and
access for its owner only (no other local user; rollcall's sessions as a role without DDL; an
older home with trust authentication converted)."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from rollcall.orchestrator.db import pgfiles
from rollcall.orchestrator.db.embedded import EmbeddedPostgres
from rollcall.orchestrator.errors import DatabaseUnavailableError
from tests.conftest import short_tmpdir

RUNTIME = "rollcall_runtime"
MIGRATOR = "rollcall_migrator"


@pytest.fixture
def home() -> Iterator[Path]:
    h = short_tmpdir("rc-emb-")
    yield h
    EmbeddedPostgres(h).stop()
    shutil.rmtree(h, ignore_errors=True)


@pytest.fixture(scope="module")
def server_home() -> Iterator[Path]:
    """One home (one ``initdb``) for the tests of a server's life after its first start: each
    takes the server as the one before left it (running or stopped) and starts it itself. The
    first of them, ``test_start_reuse_stop_restart``, gets it fresh (its file order)."""
    h = short_tmpdir("rc-emb-")
    yield h
    EmbeddedPostgres(h).stop()
    shutil.rmtree(h, ignore_errors=True)


def _query(server: EmbeddedPostgres) -> int:
    with psycopg.connect(
        host=str(server.socket_dir), port=5432, user="postgres", dbname="rollcall"
    ) as c:
        row = c.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        return int(row[0])


def _postmaster_pid(server: EmbeddedPostgres) -> int:
    pid = server.status().pid
    assert pid is not None
    return pid


def test_start_reuse_stop_restart(server_home: Path) -> None:
    home = server_home
    server = EmbeddedPostgres(home)
    st = server.status()
    assert not st.running and not st.initialised

    url = server.ensure_running()  # rollcall's sessions: the runtime role, no password
    assert url.startswith(f"postgresql+psycopg://{RUNTIME}@/rollcall?host=")
    pid = _postmaster_pid(server)
    _query(server)

    # Another handle (as a later command would make) reuses the same server.
    assert EmbeddedPostgres(home).ensure_running() == url
    assert _postmaster_pid(EmbeddedPostgres(home)) == pid

    assert server.stop() is True
    assert server.status().running is False
    assert server.stop() is False  # stopping twice is harmless

    server.ensure_running()  # warm restart keeps the data directory
    assert server.status().running and _postmaster_pid(server) != pid
    _query(server)


def test_data_survives_restart(server_home: Path) -> None:
    home = server_home
    server = EmbeddedPostgres(home)
    server.ensure_running()
    with psycopg.connect(
        host=str(server.socket_dir), port=5432, user="postgres", dbname="rollcall"
    ) as c:
        c.execute("CREATE TABLE keep (x int)")
        c.execute("INSERT INTO keep VALUES (42)")
    server.stop()
    server.ensure_running()
    with psycopg.connect(
        host=str(server.socket_dir), port=5432, user="postgres", dbname="rollcall"
    ) as c:
        assert c.execute("SELECT x FROM keep").fetchone() == (42,)


CLIENT = textwrap.dedent(
    """
    import sys, time, psycopg
    from pathlib import Path
    from rollcall.orchestrator.db.embedded import EmbeddedPostgres
    s = EmbeddedPostgres(Path(sys.argv[1]))
    s.ensure_running()
    conn = psycopg.connect(host=str(s.socket_dir), port=5432, user="postgres", dbname="rollcall")
    conn.execute("BEGIN")
    conn.execute("CREATE TABLE held (x int)")
    print("ready", flush=True)
    time.sleep(600)
    """
)


def test_survives_sigkilled_client(server_home: Path) -> None:
    home = server_home
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(home)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    server = EmbeddedPostgres(home)
    pid = _postmaster_pid(server)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    # The next command reuses the same server; the killed client's transaction is gone.
    server.ensure_running()
    assert _postmaster_pid(server) == pid
    with psycopg.connect(
        host=str(server.socket_dir), port=5432, user="postgres", dbname="rollcall"
    ) as c:
        c.execute("CREATE TABLE held (x int)")  # no conflict: the open transaction rolled back
    # And it can still be stopped and started.
    assert server.stop() is True
    server.ensure_running()
    _query(server)


def test_restarts_after_postmaster_sigkill(server_home: Path) -> None:
    home = server_home
    server = EmbeddedPostgres(home)
    server.ensure_running()
    pid = _postmaster_pid(server)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and server.status().running:
        time.sleep(0.05)
    assert not server.status().running

    server.ensure_running()  # stale postmaster.pid, crash recovery
    assert _postmaster_pid(server) != pid
    _query(server)


def test_concurrent_first_use_starts_one_server(home: Path) -> None:
    code = "import sys; from pathlib import Path; from rollcall.orchestrator.db.embedded import EmbeddedPostgres; print(EmbeddedPostgres(Path(sys.argv[1])).ensure_running())"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(home)], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert len(set(outs)) == 1
    _query(EmbeddedPostgres(home))


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``rollcall ARGS`` in a subprocess on ``home``'s embedded database (no
    ROLLCALL_DATABASE_URL)."""
    env = {k: v for k, v in os.environ.items() if k != "ROLLCALL_DATABASE_URL"}
    env["ROLLCALL_HOME"] = str(home)
    return subprocess.run(
        [sys.executable, "-m", "rollcall.orchestrator.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_cli_db_commands_on_embedded(home: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return _cli(home, *args)

    r = run("task", "list")  # starts the server on first use, but refuses: no schema
    assert r.returncode != 0 and "run `rollcall db upgrade` first" in r.stderr
    assert run("db", "upgrade").returncode == 0
    assert run("db", "check").returncode == 0
    # the migration ran as the migrator, which owns everything; the sessions' role may not
    # run DDL nor a program on the server (as the superuser sessions of old could)
    url = EmbeddedPostgres(home).ensure_running()
    with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as c:
        assert c.execute("SELECT current_user").fetchone() == (RUNTIME,)
        owners = c.execute(
            "SELECT DISTINCT tableowner FROM pg_tables WHERE schemaname = 'public'"
        ).fetchall()
        assert owners == [(MIGRATOR,)]
        for sql in (
            "CREATE TABLE rogue (x int)",
            "TRUNCATE events",
            "DROP TABLE events",
            "COPY events (message) FROM PROGRAM 'id'",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                c.execute(sql)
    r = run("task", "register", "calc", "--plugin", "echo")
    assert r.returncode == 0, r.stderr
    r = run("db", "status", "--json")
    assert '"running": true' in r.stdout
    r = run("db", "stop")
    assert r.returncode == 0 and "stopped" in r.stdout
    assert not EmbeddedPostgres(home).status().running
    r = run("task", "list", "--json")  # started again on use, data intact
    assert r.returncode == 0 and '"calc"' in r.stdout


@pytest.mark.timeout(600)  # five `rollcall run` processes: 232-286 s at a load of 50
def test_run_migrates_a_fresh_embedded_database_but_not_an_external_one(
    home: Path, empty_db_url: str
) -> None:
    """``rollcall run`` on a fresh home migrates the embedded database, as the quickstart does
    (the README's "next:" lines run it there); an external database keeps its operator's
    ``rollcall db upgrade`` step and is left untouched."""
    config = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return _cli(home, *args)

    # --resume of a job that does not exist: refused right after the schema step, cheaply
    r = run("run", config, "--resume", "--no-live")
    assert "no rollcall schema" not in r.stderr, r.stderr
    assert r.returncode != 0 and "nothing to resume" in r.stderr, r.stderr
    assert "schema migrated to" in r.stdout and "(was none)" in r.stdout
    assert run("db", "check").returncode == 0
    r = run("run", config, "--resume", "--no-live")  # at head now: nothing to say
    assert "nothing to resume" in r.stderr and "schema migrated" not in r.stdout

    r = run("--database-url", empty_db_url, "run", config, "--resume", "--no-live")
    assert r.returncode != 0 and "run `rollcall db upgrade` first" in r.stderr, r.stderr
    with psycopg.connect(empty_db_url.replace("postgresql+psycopg", "postgresql")) as c:
        row = c.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone()
        assert row == (0,)


def test_its_log_is_rotated_at_a_start_once_over_its_bound(server_home: Path) -> None:
    """``postgres.log`` (the server's stderr) grows over a job of weeks, a restart at a time:
    a start finding it over ``LOG_MAX_BYTES`` moves it to ``postgres.log.1`` (one kept)."""
    home = server_home
    from rollcall.orchestrator.db import embedded

    server = EmbeddedPostgres(home)
    server.ensure_running()
    server.stop()
    old = server.log_path.read_bytes()
    server.log_path.write_bytes(old + b"x" * embedded.LOG_MAX_BYTES)
    server.ensure_running()
    rotated = server.log_path.with_name("postgres.log.1")
    assert rotated.stat().st_size > embedded.LOG_MAX_BYTES
    assert server.log_path.stat().st_size < 100_000  # this start's lines only
    _query(server)


def test_an_immediate_stop_is_a_crash_it_recovers_from(server_home: Path) -> None:
    home = server_home
    server = EmbeddedPostgres(home)
    server.ensure_running()
    assert server.stop(mode="immediate") is True
    server.ensure_running()
    _query(server)
    assert "not properly shut down" in server.log_path.read_text()


def _as_nobody(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by the system's Python as the local user ``nobody``."""
    return subprocess.run(
        ["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups",
         "/usr/bin/python3", "-c", code],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def _assert_nobody_cannot_connect(server: EmbeddedPostgres) -> None:
    sock = server.socket_dir / ".s.PGSQL.5432"
    assert sock.exists()
    r = _as_nobody(
        "import socket\n"
        f"s = socket.socket(socket.AF_UNIX); s.connect({str(sock)!r}); print('connected')"
    )
    assert r.returncode != 0 and "PermissionError" in r.stderr, r.stdout + r.stderr
    r = _as_nobody(
        "import socket\n"
        "socket.create_connection(('127.0.0.1', 5432), timeout=5); print('connected')"
    )
    assert r.returncode != 0 and "connected" not in r.stdout, r.stdout + r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_no_other_local_user_connects(server_home: Path) -> None:
    """The socket's folder is the server's user's alone (0700) and the server has no TCP port:
    another local uid reaches neither. The rules admit the owner alone, by peer credentials."""
    server = EmbeddedPostgres(server_home)
    server.ensure_running()
    _assert_nobody_cannot_connect(server)
    st = server.socket_dir.stat()
    assert st.st_mode & 0o777 == 0o700
    assert st.st_uid == (pwd.getpwnam("embedded_postgres").pw_uid)
    with psycopg.connect(
        host=str(server.socket_dir), port=5432, user="postgres", dbname="postgres"
    ) as c:
        assert c.execute("SHOW listen_addresses").fetchone() == ("",)
        rules = c.execute("SELECT type, auth_method, options FROM pg_hba_file_rules").fetchall()
    assert rules == [("local", "peer", ["map=owner"])]
    ident = (server.pgdata / "pg_ident.conf").read_text().split("\n")
    assert "owner root all" in ident


@pytest.mark.skipif(os.geteuid() != 0, reason="as a normal user the server runs as that user")
def test_an_unreachable_home_is_refused_and_left_as_it_was() -> None:
    """As root the server runs as ``embedded_postgres``: a home below a folder it cannot search
    is refused, naming that folder and the fix, with nothing written and no mode changed."""
    private = short_tmpdir("rc-priv-")
    private.chmod(0o700)
    try:
        home = private / "home"
        with pytest.raises(DatabaseUnavailableError) as err:
            EmbeddedPostgres(home).ensure_running()
        assert f"{private} (mode 0700)" in str(err.value)
        assert f"chmod o+x {private}" in str(err.value) and "ROLLCALL_HOME" in str(err.value)
        assert private.stat().st_mode & 0o777 == 0o700
        assert list(private.iterdir()) == []
    finally:
        shutil.rmtree(private, ignore_errors=True)


def test_binaries_the_server_user_cannot_reach_run_from_a_shared_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As root, PostgreSQL's programs in a virtual environment under a private folder (a
    checkout under /root) are copied once to ``SHARED_BINARIES``, readable by the server's user,
    and run from there; the private folder keeps its mode."""
    assert os.geteuid() == 0, "runs as root, as CI does"  # fails, never skips
    private = short_tmpdir("rc-venv-")
    private.chmod(0o700)
    shared = short_tmpdir("rc-shared-") / "postgres-bin"
    try:
        venv_tree = private / "site-packages" / "embedded_postgres" / "pginstall"
        shutil.copytree(pgfiles._bin_dir().parent, venv_tree, symlinks=True)
        monkeypatch.setattr(pgfiles, "_bin_dir", lambda: venv_tree / "bin")
        monkeypatch.setattr(pgfiles, "SHARED_BINARIES", shared)
        programs = pgfiles._binaries()
        assert programs.parent.parent == shared, programs
        assert pgfiles._binaries() == programs  # made once
        out = subprocess.run(
            [shutil.which("setpriv") or "setpriv", "--reuid", pgfiles.SYSTEM_USER, "--regid",
             pgfiles.SYSTEM_USER, "--clear-groups", str(programs / "postgres"), "--version"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert out.returncode == 0 and "PostgreSQL" in out.stdout, out
        assert private.stat().st_mode & 0o777 == 0o700
    finally:
        shutil.rmtree(private, ignore_errors=True)
        shutil.rmtree(shared.parent, ignore_errors=True)


TRUST_HBA = """\
local   all             all                                     trust
host    all             all             127.0.0.1/32            trust
host    all             all             ::1/128                 trust
"""


def test_a_trust_home_is_converted_at_its_next_start(
    server_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A home of an earlier rollcall (trust authentication, a socket folder anyone may enter,
    its database made, migrated and used by the superuser), its server still running, is
    converted by the next command: the rules rewritten and reloaded, the roles created, the
    database's objects handed to the migrator, one line said; rollcall then works as the
    runtime role on the old data."""
    from rollcall.orchestrator.db import migrate

    home = server_home
    server = EmbeddedPostgres(home)
    server.ensure_running()
    sock: dict[str, Any] = {"host": str(server.socket_dir), "port": 5432, "user": "postgres"}
    with psycopg.connect(**sock, dbname="postgres", autocommit=True) as c:
        c.execute("DROP DATABASE rollcall WITH (FORCE)")
        c.execute("CREATE DATABASE rollcall")  # the superuser's, as before
    admin_url = f"postgresql+psycopg://postgres@/rollcall?host={server.socket_dir}&port=5432"
    engine = sa.create_engine(admin_url, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        migrate.upgrade(conn)
        conn.commit()
    engine.dispose()
    r = _cli(home, "--database-url", admin_url, "task", "register", "calc", "--plugin", "echo")
    assert r.returncode == 0, r.stderr
    server.stop()
    (server.pgdata / "pg_hba.conf").write_text(TRUST_HBA)
    server.root.chmod(0o755)
    server._start()  # the old server, running with trust
    capsys.readouterr()

    url = EmbeddedPostgres(home).ensure_running()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "used trust authentication; converted" in err, err
    assert (server.pgdata / "pg_hba.conf").read_text().splitlines()[0].startswith("# rollcall")
    assert server.socket_dir.stat().st_mode & 0o777 == 0o700
    with psycopg.connect(**sock, dbname="rollcall") as c:
        owners = c.execute(
            "SELECT DISTINCT pg_get_userbyid(relowner) FROM pg_class "
            "WHERE relnamespace = 'public'::regnamespace UNION "
            "SELECT DISTINCT pg_get_userbyid(proowner) FROM pg_proc "
            "WHERE pronamespace = 'public'::regnamespace UNION "
            "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = 'rollcall'"
        ).fetchall()
        assert owners == [(MIGRATOR,)]
        row = c.execute("SELECT id FROM tasks WHERE name = 'calc'").fetchone()
        assert row is not None
        partition = f"trajectories_t{row[0]}"  # made by the superuser's SECURITY DEFINER function
        assert c.execute(
            "SELECT has_table_privilege(%s, %s, 'INSERT'), "
            "has_table_privilege(%s, 'trajectory_segments', 'DELETE'), "
            "has_table_privilege(%s, 'events', 'DELETE')",
            (RUNTIME, partition, RUNTIME, RUNTIME),
        ).fetchone() == (True, True, False)
    if os.geteuid() == 0:
        _assert_nobody_cannot_connect(server)
    assert url.startswith(f"postgresql+psycopg://{RUNTIME}@")
    r = _cli(home, "task", "list", "--json")  # the runtime role, on the old data
    assert r.returncode == 0 and '"calc"' in r.stdout, r.stderr
    r = _cli(home, "db", "upgrade")  # the migrator, who owns the schema now
    assert r.returncode == 0 and "Schema already at head" in r.stdout, r.stderr
    assert "converted" not in r.stderr  # once
