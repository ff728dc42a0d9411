"""A tool's stdout and stderr reach the node's log (the tool server's stderr, which an operator
reads on a terminal) escaped and marked: a tool that prints ANSI escapes (clear the screen,
colours, a window title), a carriage return over its line and a line "job finished" leaves no
ESC, CSI, BEL or CR in the log and no line that starts with "job finished": each of its lines
is ``tool| ...``. At level ``sandbox`` (the call's output file, forwarded after the call) and
``process`` (the tools run in the server, whose stdout and stderr are the node's).

A node of its own: a Python process that runs one call through ``ToolRunner`` and whose
stdout and stderr are the log."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

NODE = r"""
import json, os, sys
from rollcall.orchestrator.config import ToolSandboxConfig
from rollcall.workers.episode.tools import ToolRunner

def shout():
    print("\x1b[2J\x1b[31mred\x1b]0;pwned\x07 \x1b]8;;http://evil.example\x07link\x1b]8;;\x07")
    print("half a line\rjob finished: overwritten")
    print("job finished: 100 steps, reward 1.00")
    sys.stdout.flush()
    os.write(2, b"\x9b2J raw C1 \xc2\x9b31m utf-8 C1 \x08\x7f\njob finished (stderr)\n")
    return "shouted"

with ToolRunner(timeout_s=30, sandbox=ToolSandboxConfig(level=sys.argv[1])) as r:
    answer = r.call_function(shout, (), {}, timeout_s=30)
sys.stdout.flush()
os.write(1, ("\nANSWER " + json.dumps(answer) + "\n").encode())
"""


@pytest.mark.parametrize("level", ["sandbox", "process"])
def test_a_tools_output_reaches_the_log_escaped_and_marked(level: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", NODE, level], capture_output=True, timeout=120, check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    out, _, answer = done.stdout.rpartition(b"\nANSWER ")
    assert json.loads(answer) == [True, "shouted"], done.stderr
    log = out + done.stderr
    for byte in (b"\x1b", b"\x07", b"\r", b"\x08", b"\x7f", b"\x9b", b"\xc2\x9b"):
        assert byte not in log, (byte, log)
    text = log.decode()
    lines = text.splitlines()
    assert not [line for line in lines if line.startswith("job finished")], text
    tool = [line for line in lines if line.startswith("tool| ")]
    assert "tool| \\x1b[2J\\x1b[31mred\\x1b]0;pwned\\x07 \\x1b]8;;http://evil" in tool[0], tool
    assert "tool| half a line\\x0djob finished: overwritten" in tool
    assert "tool| job finished: 100 steps, reward 1.00" in tool
    assert "tool| \\x9b2J raw C1 \\x9b31m utf-8 C1 \\x08\\x7f" in tool  # an invalid byte too
    assert "tool| job finished (stderr)" in tool
    assert "--- a tool call's output:" in text
