"""The trainer-memory benchmark's parts that run here: one configuration of
``ops/bench/trainer_memory.py`` on the CPU (the tiny model), and ``ops/gpu/trainer_memory.py``,
which on a machine without CUDA refuses at once, with one JSON line, before importing anything
heavy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _last_json(stdout: str) -> dict[str, object]:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    assert lines, stdout
    return json.loads(lines[-1])


def test_one_configuration_measures_a_real_trainer_step(tiny_dir: Path) -> None:
    cmd = [sys.executable, "ops/bench/trainer_memory.py", "--model", str(tiny_dir),
           "--device", "cpu", "--threads", "1", "--one", "after", "512"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    row = _last_json(done.stdout)
    assert row["fit"] is True and row["setup"] == "after" and row["tokens"] == 512
    assert float(row["peak_gib"]) >= float(row["set_up_gib"]) > 0  # type: ignore[arg-type]
    assert "cuda_peak_gib" not in row  # the device's figures only on a device


def test_the_gpu_script_refuses_without_cuda() -> None:
    import torch

    assert not torch.cuda.is_available()  # this test is for the CPU machines (CI)
    done = subprocess.run(
        [sys.executable, "ops/gpu/trainer_memory.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert _last_json(done.stdout) == {
        "ok": False,
        "why": f"no CUDA device (torch {torch.__version__}, CUDA none)",
    }
