"""The embedded PostgreSQL server: one per ``ROLLCALL_HOME``, started on first use.

Guarantees:

- ``ensure_running()`` returns a URL of a server that answered a query. It initialises the data
  directory on first use, reuses a server that is already up (started by any earlier process),
  and starts a new one when the old one is gone, including after the postmaster or one of its
  clients was SIGKILLed (a stale ``postmaster.pid`` of a dead or zombie postmaster is removed).
- Start and stop are serialised across processes by a file lock in ``ROLLCALL_HOME``.
- For its owner only: the socket's folder (``home/postgres``) has mode 0700 and belongs to the
  server's user; the server listens on no TCP port; ``pg_hba.conf`` accepts only ``peer``
  authentication on the socket, for the owner's login name (``pg_ident.conf``), so no other
  local user connects, by the socket or otherwise.
- rollcall's sessions use the runtime role ``rollcall_runtime`` (``url()``): data, no DDL.
  Migrations run as ``rollcall_migrator`` (``url(role=MIGRATOR)``), which owns the database;
  the roles are those of ``postgres-roles.sql`` (the file an external deployment runs), set up
  by running that very file with the bundled ``psql``. The superuser ``postgres`` is for
  the owner's administration (``url(role=SUPERUSER)``: creating databases, the tests'
  templates).
- A home made by an earlier rollcall (``trust`` authentication, everything owned by
  ``postgres``) is converted at its next start: authentication rewritten, roles created, its
  objects handed to the migrator, one line on stderr.
- Run as root, PostgreSQL refuses to start, so the server runs as the unprivileged system user
  ``embedded_postgres`` (created if missing), and owns ``home/postgres``. No permission is added
  to any folder above it: a folder there that the user cannot search is refused with an error
  naming it, before anything is written (root's default home, ``/var/lib/rollcall``, is
  reachable). PostgreSQL's programs, when that user cannot reach them (a virtual environment
  under /root), run from a copy in ``SHARED_BINARIES`` instead.
- Health is judged by connecting, never by pid files alone.

The package ``embedded-postgres`` supplies the PostgreSQL binaries; its own client-counting
lifecycle is not used (a SIGKILLed client stays in its pid list forever).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from rollcall.orchestrator import procfs
from rollcall.orchestrator.db.pgfiles import (
    SYSTEM_USER,
    _binaries,
    _ensure_system_user,
    _make_tree_readable,
    _searchable,
)
from rollcall.orchestrator.errors import DatabaseUnavailableError

SUPERUSER = "postgres"
MIGRATOR = "rollcall_migrator"
RUNTIME = "rollcall_runtime"
DATABASE = "rollcall"
ROLES_SQL = Path(__file__).with_name("postgres-roles.sql")
# the first line of the pg_hba.conf this module writes: a file without it is an older home's
HBA_MARK = "# rollcall: peer authentication on the socket for the owner only; no TCP"
PORT = 5432
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
START_ATTEMPTS = 3
# postgres.log (the server's stderr: startups, checkpoints, errors) over this at a start is
# moved to postgres.log.1, the one older file kept: a job of weeks keeps at most twice this
LOG_MAX_BYTES = 10 << 20
_SOCKET_PATH_MAX = 100  # sun_path is 108 bytes on Linux; keep a margin


@dataclass(frozen=True)
class EmbeddedStatus:
    running: bool
    initialised: bool
    pgdata: Path
    socket_dir: Path
    pid: int | None
    url: str

    def to_json(self) -> dict[str, Any]:
        return {
            "running": self.running,
            "initialised": self.initialised,
            "pgdata": str(self.pgdata),
            "socket_dir": str(self.socket_dir),
            "pid": self.pid,
            "url": self.url,
        }


class EmbeddedPostgres:
    """Lifecycle of the PostgreSQL server kept under ``home/postgres``."""

    def __init__(self, home: Path) -> None:
        self.home = home.expanduser().resolve()
        self.root = self.home / "postgres"
        self.pgdata = self.root / "data"
        self.log_path = self.root / "postgres.log"
        self.lock_path = self.home / "postgres.lock"
        self.socket_dir = self._choose_socket_dir()

    # -- public -----------------------------------------------------------------------------

    def url(self, database: str = DATABASE, role: str = RUNTIME) -> str:
        """The URL for ``role`` (no password: peer authentication on the socket)."""
        return f"postgresql+psycopg://{role}@/{database}?host={self.socket_dir}&port={PORT}"

    def ensure_running(self) -> str:
        """Start the server if it is not answering; set up (or convert) its authentication,
        roles and ``rollcall`` database. Returns the runtime role's URL."""
        if self._auth_current() and self._probe():
            return self.url()
        self._check_reachable()  # before anything is written in the home
        with self._locked():
            if self._probe() is None:
                fresh = self._init_if_needed()
                converted = self._write_auth() and not fresh
                self._start()
            elif converted := self._write_auth():  # an older home's server, still running
                self._prepare_dirs()
                self._reload()
            if not self._probe():
                self._set_up_roles()
            if converted:
                sys.stderr.write(
                    f"rollcall: the embedded PostgreSQL in {self.root} used trust "
                    f"authentication; converted: only {_login_name()} may connect (peer, "
                    f"socket folder 0700), and rollcall now connects as {RUNTIME}\n"
                )
        return self.url()

    def stop(self, mode: str = "fast") -> bool:
        """Stop the server (``fast`` shutdown; ``immediate``: as a crash, recovered from the WAL
        at the next start). Returns False when it was not running."""
        with self._locked():
            pid = self._postmaster_pid()
            if pid is None or not _alive(pid):
                self._remove_stale_pidfile()
                return False
            self._run_pg(
                "pg_ctl",
                [
                    "-D",
                    str(self.pgdata),
                    "-m",
                    mode,
                    "-w",
                    "-t",
                    str(int(STOP_TIMEOUT_S)),
                    "stop",
                ],
            )
            return True

    def status(self) -> EmbeddedStatus:
        pid = self._postmaster_pid()
        return EmbeddedStatus(
            running=self._answers(),
            initialised=(self.pgdata / "PG_VERSION").exists(),
            pgdata=self.pgdata,
            socket_dir=self.socket_dir,
            pid=pid if pid is not None and _alive(pid) else None,
            url=self.url(),
        )

    # -- internals --------------------------------------------------------------------------

    def _choose_socket_dir(self) -> Path:
        if len(str(self.root / f".s.PGSQL.{PORT}")) <= _SOCKET_PATH_MAX:
            return self.root
        digest = hashlib.sha256(str(self.root).encode()).hexdigest()[:12]
        return Path("/tmp") / f"rollcall-pg-{digest}"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.home.mkdir(parents=True, exist_ok=True)
        with self.lock_path.open("a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _answers(self) -> bool:
        return self._probe() is not None

    def _probe(self) -> bool | None:
        """None: the server does not answer; False: it answers but its roles and database
        are not set up (a fresh or an older home); True: ready."""
        try:
            if not (self.socket_dir / f".s.PGSQL.{PORT}").exists():
                return None
            with psycopg.connect(
                host=str(self.socket_dir),
                port=PORT,
                user=SUPERUSER,
                dbname=SUPERUSER,
                connect_timeout=3,
            ) as conn:
                row = conn.execute(
                    "SELECT 1 FROM pg_database WHERE datname = %s AND pg_get_userbyid(datdba) = %s",
                    (DATABASE, MIGRATOR),
                ).fetchone()
            return row is not None
        except (OSError, psycopg.Error):
            return None

    def _auth_current(self) -> bool:
        try:
            with (self.pgdata / "pg_hba.conf").open() as fh:
                return fh.readline().rstrip("\n") == HBA_MARK
        except OSError:
            return False

    def _write_auth(self) -> bool:
        """Write ``pg_hba.conf`` and ``pg_ident.conf`` unless ``pg_hba.conf`` is this
        module's already; True when it wrote them."""
        if self._auth_current():
            return False
        owner = _login_name()
        _write_as_server(
            self.pgdata / "pg_ident.conf",
            "# rollcall: the OS user who owns this embedded PostgreSQL, as any of its roles\n"
            f"owner {owner} all\n",
        )
        _write_as_server(
            self.pgdata / "pg_hba.conf",
            f"{HBA_MARK}\n# TYPE  DATABASE  USER  METHOD\nlocal   all       all   peer map=owner\n",
        )
        return True

    def _reload(self) -> None:
        """Make the running server read its configuration again, and wait until it has."""

        def connect() -> psycopg.Connection[Any]:
            return psycopg.connect(
                host=str(self.socket_dir), port=PORT, user=SUPERUSER, dbname=SUPERUSER
            )

        with connect() as conn:
            before = conn.execute("SELECT pg_conf_load_time(), pg_reload_conf()").fetchone()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:  # a new session has the postmaster's load time
            time.sleep(0.05)
            with connect() as conn:
                now = conn.execute("SELECT pg_conf_load_time()").fetchone()
            if before is not None and now is not None and now[0] > before[0]:
                return
        raise DatabaseUnavailableError(
            f"embedded PostgreSQL did not reload its configuration; see {self.log_path}"
        )

    def _set_up_roles(self) -> None:
        """The roles and the database of ``postgres-roles.sql`` (the file itself, run with the
        bundled ``psql``), then, for an older home, its objects handed to the migrator."""
        # Nobody logs in with a password (peer only): random ones, never stored.
        cmd = [
            str(_binaries() / "psql"),
            "-h", str(self.socket_dir), "-p", str(PORT), "-U", SUPERUSER, "-d", SUPERUSER,
            "-X", "-q", "-v", "ON_ERROR_STOP=1", "-v", f"database={DATABASE}",
            "-v", f"migrator_password={secrets.token_urlsafe(24)}",
            "-v", f"runtime_password={secrets.token_urlsafe(24)}",
            "-f", str(ROLES_SQL),
        ]  # fmt: skip
        proc = subprocess.run(
            cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, check=False
        )
        if proc.returncode != 0:
            raise DatabaseUnavailableError(
                f"embedded PostgreSQL: setting up its roles failed: {proc.stderr.strip()}"
            )
        with psycopg.connect(
            host=str(self.socket_dir), port=PORT, user=SUPERUSER, dbname=DATABASE, autocommit=True
        ) as conn:
            conn.execute(ADOPT_SQL)

    def _run_as(self) -> dict[str, Any]:
        """As root: the system user, with its own group and no supplementary groups (root's
        group would otherwise decide access to folders like a 0701 temporary directory)."""
        if os.geteuid() != 0:
            return {}
        entry = pwd.getpwnam(SYSTEM_USER)
        return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}

    def _run_pg(self, exe: str, args: list[str], timeout: float = START_TIMEOUT_S) -> str:
        cmd = [str(_binaries() / exe), *args]
        try:
            proc = subprocess.run(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if exe != "pg_ctl" else subprocess.DEVNULL,
                stderr=subprocess.PIPE if exe != "pg_ctl" else subprocess.DEVNULL,
                text=True,
                timeout=timeout,
                **self._run_as(),
                cwd=str(self.root) if self.root.exists() else None,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise DatabaseUnavailableError(
                f"embedded PostgreSQL: {exe} did not finish within {timeout:.0f} s; "
                f"see {self.log_path}"
            ) from None
        if proc.returncode != 0:
            detail = (proc.stderr or "").strip().splitlines()[-1:] if proc.stderr else []
            tail = self._log_tail()
            raise DatabaseUnavailableError(
                f"embedded PostgreSQL: {exe} failed (exit {proc.returncode})"
                + (f": {detail[0]}" if detail else "")
                + (f"; server log ends with: {tail}" if tail else "")
            )
        return proc.stdout or ""

    def _log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(lines[-3:])

    def _check_reachable(self) -> None:
        """As root: every existing folder above the server's folders, and above its binaries,
        must be searchable by the system user; otherwise an error naming the folder and the
        fix, before anything is written. No permission is ever added to them."""
        if os.geteuid() != 0:
            return
        entry = _ensure_system_user(SYSTEM_USER)
        for target in (self.root, self.socket_dir, _binaries().parent):
            for d in reversed(target.parents):
                if not d.exists():
                    break
                if not _searchable(d, entry.pw_uid, entry.pw_gid):
                    mode = stat.S_IMODE(d.stat().st_mode)
                    raise DatabaseUnavailableError(
                        f"running as root, the embedded PostgreSQL runs as the system user "
                        f"{SYSTEM_USER!r}, which cannot reach {target}: {d} (mode {mode:04o}) "
                        f"does not let it search; set ROLLCALL_HOME to a folder it can reach "
                        f"(root's default is /var/lib/rollcall), run rollcall as a normal "
                        f"user, or, to open {d} to every local user, `chmod o+x {d}`"
                    )

    def _prepare_dirs(self) -> None:
        """``home/postgres`` (and a socket folder of its own): mode 0700, the server's user's.
        A socket folder in /tmp that someone else made is refused."""
        entry = _ensure_system_user(SYSTEM_USER) if os.geteuid() == 0 else None
        uid = entry.pw_uid if entry else os.geteuid()
        for d in dict.fromkeys((self.root, self.socket_dir)):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = d.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (uid, os.geteuid()):
                raise DatabaseUnavailableError(
                    f"embedded PostgreSQL: {d} is not a folder of this user's (owner uid "
                    f"{st.st_uid}); remove it, or set ROLLCALL_HOME elsewhere"
                )
            if entry is not None:
                os.chown(d, entry.pw_uid, entry.pw_gid, follow_symlinks=False)
            d.chmod(0o700)
        if entry is not None:
            _make_tree_readable(_binaries().parent)

    def _init_if_needed(self) -> bool:
        """``initdb`` unless the data directory is initialised; True when it ran."""
        if (self.pgdata / "PG_VERSION").exists():
            return False
        self._prepare_dirs()
        if self.pgdata.exists():  # a half-initialised directory from an interrupted initdb
            shutil.rmtree(self.pgdata)
        self._run_pg(
            "initdb",
            [
                "-D", str(self.pgdata),
                "-U", SUPERUSER,
                "--auth-local=peer",
                "--auth-host=reject",
                "--encoding=UTF8",
                "--no-instructions",
            ],
        )  # fmt: skip
        return True

    def _postmaster_pid(self) -> int | None:
        try:
            first = (self.pgdata / "postmaster.pid").read_text().splitlines()[0]
            return int(first)
        except (OSError, ValueError, IndexError):
            return None

    def _remove_stale_pidfile(self) -> None:
        """Remove lock files of a postmaster that is dead or a zombie. PostgreSQL itself only
        asks ``kill(pid, 0)``, which succeeds on a zombie, and would refuse to start."""
        pid = self._postmaster_pid()
        if pid is not None and not _alive(pid):
            with contextlib.suppress(FileNotFoundError):
                (self.pgdata / "postmaster.pid").unlink()
        sock_lock = self.socket_dir / f".s.PGSQL.{PORT}.lock"
        try:
            lock_pid = int(sock_lock.read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return
        if not _alive(lock_pid):
            for p in (sock_lock, self.socket_dir / f".s.PGSQL.{PORT}"):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()

    def _start(self) -> None:
        self._prepare_dirs()
        pid = self._postmaster_pid()
        if pid is not None and _alive(pid):
            # A live postmaster that does not answer: it may still be starting or recovering.
            if self._wait_until_answers(START_TIMEOUT_S):
                return
            raise DatabaseUnavailableError(
                f"embedded PostgreSQL (pid {pid}) is running but does not accept connections; "
                f"see {self.log_path}, or stop it with `rollcall db stop`"
            )
        self._rotate_log()
        options = (
            f"-c listen_addresses='' -k {self.socket_dir} -p {PORT} -c max_connections=300 "
            "-c unix_socket_permissions=0700"
        )
        args = ["-D", str(self.pgdata), "-l", str(self.log_path), "-o", options, "-w",
                "-t", str(int(START_TIMEOUT_S)), "start"]  # fmt: skip
        # Backends of a killed postmaster can hold its shared memory for a moment: retry.
        for attempt in range(START_ATTEMPTS):
            self._remove_stale_pidfile()
            try:
                self._run_pg("pg_ctl", args)
                break
            except DatabaseUnavailableError:
                if attempt == START_ATTEMPTS - 1:
                    raise
                time.sleep(1.0)
        if not self._wait_until_answers(START_TIMEOUT_S):
            raise DatabaseUnavailableError(
                f"embedded PostgreSQL started but does not accept connections; see {self.log_path}"
            )

    def _rotate_log(self) -> None:
        """At a start (the server stopped): ``postgres.log`` over ``LOG_MAX_BYTES`` becomes
        ``postgres.log.1``, replacing the older one."""
        with contextlib.suppress(OSError):
            if self.log_path.stat().st_size > LOG_MAX_BYTES:
                self.log_path.replace(self.log_path.with_name(self.log_path.name + ".1"))

    def _wait_until_answers(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._answers():
                return True
            time.sleep(0.1)
        return False


# An older home's database, made and migrated by the superuser: its objects go to the migrator,
# and the runtime role gets what postgres-roles.sql's default privileges give it on objects the
# migrator creates (and DELETE where migrations 0005 and 0008 grant it). The database's owner
# changes last: it is the mark that the setup is complete (_probe).
ADOPT_SQL = f"""
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT c.oid::regclass AS rel, c.relkind FROM pg_class c
        WHERE c.relnamespace = 'public'::regnamespace AND c.relowner <> '{MIGRATOR}'::regrole
          AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
    LOOP
        EXECUTE format('ALTER %s %s OWNER TO {MIGRATOR}', CASE r.relkind
            WHEN 'v' THEN 'VIEW' WHEN 'm' THEN 'MATERIALIZED VIEW'
            WHEN 'f' THEN 'FOREIGN TABLE' ELSE 'TABLE' END, r.rel);
    END LOOP;
    FOR r IN SELECT c.oid::regclass AS rel FROM pg_class c
        WHERE c.relnamespace = 'public'::regnamespace AND c.relowner <> '{MIGRATOR}'::regrole
          AND c.relkind = 'S' AND NOT EXISTS (
              SELECT FROM pg_depend d WHERE d.classid = 'pg_class'::regclass
                AND d.objid = c.oid AND d.deptype IN ('a', 'i'))
    LOOP
        EXECUTE format('ALTER SEQUENCE %s OWNER TO {MIGRATOR}', r.rel);
    END LOOP;
    FOR r IN SELECT p.oid::regprocedure AS fn FROM pg_proc p
        WHERE p.pronamespace = 'public'::regnamespace AND p.proowner <> '{MIGRATOR}'::regrole
    LOOP
        EXECUTE format('ALTER ROUTINE %s OWNER TO {MIGRATOR}', r.fn);
    END LOOP;
    FOR r IN SELECT t.oid::regtype AS ty FROM pg_type t
        WHERE t.typnamespace = 'public'::regnamespace AND t.typowner <> '{MIGRATOR}'::regrole
          AND t.typrelid = 0 AND t.typelem = 0 AND t.typtype IN ('e', 'd', 'c', 'r')
    LOOP
        EXECUTE format('ALTER TYPE %s OWNER TO {MIGRATOR}', r.ty);
    END LOOP;
    IF to_regclass('trajectory_segments') IS NOT NULL THEN
        GRANT DELETE ON trajectory_segments TO {RUNTIME};
    END IF;
    IF to_regclass('agent_journal') IS NOT NULL THEN
        GRANT DELETE ON agent_journal TO {RUNTIME};
    END IF;
END $$;
GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA public TO {RUNTIME};
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {RUNTIME};
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA public FROM PUBLIC;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA public TO {RUNTIME};
ALTER DATABASE {DATABASE} OWNER TO {MIGRATOR};
"""


def _login_name() -> str:
    return pwd.getpwuid(os.geteuid()).pw_name


def _write_as_server(path: Path, text: str) -> None:
    """Write a file in the data directory, owned by the server's user, mode 0600."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(0o600)
    if os.geteuid() == 0:
        entry = pwd.getpwnam(SYSTEM_USER)
        os.chown(tmp, entry.pw_uid, entry.pw_gid)
    tmp.replace(path)


def _alive(pid: int) -> bool:
    """True for a running process; False for none or a zombie (a killed, unreaped postmaster)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = procfs.stat(pid)
    return proc is None or not proc.zombie  # no /proc entry to read: os.kill said it exists
