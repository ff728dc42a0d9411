"""Running an ``ops/`` check script the way a user does (a subprocess from the repository
root) and reading the one JSON object it prints last."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from tests.conftest import PYTHON

ROOT = Path(__file__).resolve().parents[2]


def passing_report(script: str, *args: str, timeout_s: float = 540) -> dict[str, Any]:
    """``python ROOT/script args...``: its last line's JSON report, asserted to say ``ok``
    with exit status 0 (the failure message holds the report and the output's end)."""
    proc = subprocess.run(
        [PYTHON, str(ROOT / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(lines[-1])
    assert proc.returncode == 0 and report["ok"], (report, proc.stdout[-3000:])
    return report
