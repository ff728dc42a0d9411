"""Terminal hygiene (``rollcall.orchestrator.terminal``): control characters in text that user
code, a tool or the model controls are escaped before they reach the operator's terminal or
rollcall's logs. The escaping function itself; a user-code exception whose message holds ANSI
escapes, a bell, a carriage return and a fake "job finished" line, as ``rollcall events`` and
the driver's terminal print it and as driver.log and the error line on stderr get it. (A tool's
forwarded output: tests/unit/test_tool_sandbox.py.)"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path

import pytest

from rollcall.orchestrator.cli import status as cli_status
from rollcall.orchestrator.cli.common import console
from rollcall.orchestrator.domain import EventView
from rollcall.orchestrator.runner.rundir import RunDir
from rollcall.orchestrator.runner.usererrors import UserErrorReport
from rollcall.orchestrator.terminal import escape_controls
from rollcall.workers.episode.sandbox import server
from rollcall.workers.episode.usercode import UserCodeError, user_call

# clear the screen, red, a window title (OSC ... BEL), a carriage return over the line, a C1 CSI
HOSTILE = "\x1b[2J\x1b[31mred\x1b]0;pwned\x07\rjob finished\x9b0m"
CONTROLS = {*map(chr, range(0x20)), "\x7f", *map(chr, range(0x80, 0xA0))} - {"\n", "\t"}


def _clean(text: str) -> None:
    bad = sorted({c for c in text if c in CONTROLS})
    assert not bad, f"control characters {bad} in:\n{text!r}"


def test_every_control_character_but_newline_and_tab_is_escaped_visibly() -> None:
    for c in CONTROLS:
        assert escape_controls(f"a{c}b") == f"a\\x{ord(c):02x}b"
    assert escape_controls(HOSTILE) == (
        "\\x1b[2J\\x1b[31mred\\x1b]0;pwned\\x07\\x0djob finished\\x9b0m"
    )
    kept = "line\n\ttabbed  é 日本 🙂 \\x1b \u2028"
    assert escape_controls(kept) is kept  # nothing to escape: the same string, no copy


def test_the_tool_servers_copy_escapes_exactly_the_same() -> None:
    """The sandbox package imports nothing of rollcall's: its own copy, held equal here."""
    every = "".join(map(chr, range(0x3000)))
    assert server.escape_controls(every) == escape_controls(every)
    assert server.escape_controls(HOSTILE) == escape_controls(HOSTILE)


def _failure() -> UserCodeError:
    def agent(prompt: str) -> str:
        raise RuntimeError(f"{HOSTILE}\njob finished: 100 steps")

    with pytest.raises(UserCodeError) as e:
        user_call("the agent", agent, "p")
    return e.value


def test_a_user_code_exception_with_escapes_is_printed_escaped_by_rollcall_events(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Its event's message, in ``rollcall events``'s table through the CLI's console."""
    e = _failure()
    assert "\x1b[2J" in e.message  # the user's message as it is stored: the text itself
    rows = [{"created_at": "2026-12-07T20:00:00+00:00", "kind": "episode.user_error",
             "actor": "rollout-0", "message": e.message}]  # fmt: skip
    console().print(cli_status.render_events(rows))
    printed = capsys.readouterr().out
    _clean(printed)
    assert "RuntimeError: \\x1b" in printed  # (cut at 80 columns: the rest in --json)


def test_the_drivers_line_for_a_user_code_exception_with_escapes_is_escaped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The driver's line for a first user-code error (``UserErrorReport``), on the console
    ``rollcall run`` gives the driver."""
    e = _failure()
    event = EventView(
        1, "episode.user_error", "rollout-0", e.message, 1, 1,
        {**e.payload(), "task": "sums", "episode_id": 7, "prompt_index": 3},
        datetime.now(UTC),
    )  # fmt: skip
    driver_console = console()  # `rollcall run` hands the driver this console
    report = UserErrorReport(lambda after, kinds: [event] if after < 1 else [], 0,
                             lambda m: driver_console.print(m, markup=False))  # fmt: skip
    report.poll()
    said = capsys.readouterr().out
    _clean(said)
    assert "\\x1b]0;pwned\\x07" in said
    assert not any(line.startswith("job finished") for line in said.splitlines())


def test_driver_log_and_the_error_line_get_the_message_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    e = _failure()
    release = RunDir(tmp_path).capture_logs()
    try:
        log = logging.getLogger("rollcall.test_terminal")
        log.warning("%s\n%s", e.message, e.trace)  # as UserErrorReport logs a first failure
        log.error("user code failed: %s", e.message)
        try:
            raise RuntimeError(HOSTILE)
        except RuntimeError:
            log.exception("episode failed")
    finally:
        release()
    text = (tmp_path / "driver.log").read_text()
    _clean(text)
    assert text.count("\\x1b[2J") >= 4 and "job finished: 100 steps" in text
    stderr = capsys.readouterr().err
    _clean(stderr)
    assert "error: user code failed: the agent raised RuntimeError: \\x1b[2J" in stderr
