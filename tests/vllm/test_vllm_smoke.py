"""``ops/gpu/vllm_smoke.py --device cpu``: the adapter against real vLLM, every behaviour
log-prob checked against the trainer's own recomputation (float32: within 1e-4 per token)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PYTHON

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]


def test_the_vllm_smoke_check_passes_on_cpu() -> None:
    proc = subprocess.run(
        [PYTHON, str(ROOT / "ops" / "gpu" / "vllm_smoke.py"), "--device", "cpu", "--loops", "4"],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=ROOT,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    report = json.loads(lines[-1])
    assert proc.returncode == 0 and report["ok"], (report, proc.stdout[-3000:])
    figures = report["figures"]
    assert report["dtype"] == "float32" and report["tolerance"] == 1e-4
    for part in ("agent_loops", "long", "after_load"):
        assert figures[part]["max_abs_err"] < 1e-4, figures
