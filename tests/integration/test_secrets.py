"""Database passwords never reach output or logs, against a database URL with a password that
cannot be reached: the operator commands of the operations layer (output), and the buffer's
retries during an outage and the metrics exporter (every log record, captured at DEBUG,
SQLAlchemy's and psycopg's included). ``test_cli_tasks.py`` covers the task and db commands."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest

from rollcall.orchestrator.buffer.control import ControlPlaneBuffer
from rollcall.orchestrator.config import BufferConfig
from rollcall.orchestrator.db.engine import Database, normalise_url
from rollcall.orchestrator.runner.metrics import MetricsExporter
from rollcall.orchestrator.settings import resolve_database
from tests.conftest import make_cli_runner

PASSWORD = "s3cr3t-Hunter2-pw"
URL = f"postgresql://rc:{PASSWORD}@127.0.0.1:9/rc"  # port 9: connection refused at once


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG)
    return caplog


def _unreachable() -> Database:
    return Database(normalise_url(URL), resolve_database(URL))


def test_operations_commands_never_print_the_password(
    capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLCALL_DATABASE_URL", URL)
    run = make_cli_runner(capsys)
    for args in (
        ["status", "--json"],
        ["status", "--job", "x"],
        ["worker", "list"],
        ["buffer", "stats", "--json"],
        ["events", "--since", "1h"],
        ["drill", "kill-rollout", "--job", "x", "--yes"],
    ):
        r = run(*args)
        assert r.code == 6, (args, r.err)
        assert "rc:***@127.0.0.1:9/rc" in r.err  # the URL is named, masked
        assert PASSWORD not in r.out + r.err, args


def test_buffer_retries_and_the_exporter_never_log_the_password(
    logs: pytest.LogCaptureFixture,
) -> None:
    db = _unreachable()
    try:
        buf = ControlPlaneBuffer(db, 1, BufferConfig(lease_s=2.0, retry_window_s=0.5))
        with pytest.raises(Exception) as raised:
            buf.depth()
        retries = [r for r in logs.records if "database unavailable" in r.getMessage()]
        assert retries, "the retry policy logged nothing"
        assert PASSWORD not in str(raised.value) and PASSWORD not in repr(raised.value)
        exporter = MetricsExporter(db, 1, "j")
        exporter.refresh()
        metrics = "\n".join(str(m) for m in exporter.collect())
        assert re.search(r"rollcall_database_up.*value=0", metrics)
    finally:
        db.dispose()
    assert PASSWORD not in logs.text
    assert PASSWORD not in metrics
