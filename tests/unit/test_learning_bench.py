"""``ops/bench/learning.py``: async against sync at equal trained samples, from run
directories (the figures of ``ops/bench/RESULTS.md``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run_dir(path: Path, mode: str, evals: list[tuple[int, int, float, list[float]]]) -> Path:
    """A run directory whose evaluation at policy version ``v`` follows ``samples`` trained
    samples, ``seconds`` after the first record, with per-prompt ``rewards``."""
    path.mkdir()
    (path / "config.yaml").write_text(f"run:\n  mode: {mode}\n")
    t0 = 1000.0
    lines = []
    for v, samples, seconds, rewards in evals:
        if v > 0:
            lines.append(
                {
                    "kind": "step",
                    "policy_version": v,
                    "trained_samples": samples,
                    "time": t0 + seconds,
                }
            )
        else:
            lines.append({"kind": "step", "policy_version": 1, "trained_samples": 48, "time": t0})
        lines.append(
            {
                "kind": "eval",
                "step": v,
                "time": t0 + seconds + 1,
                "reward": {"calc": sum(rewards) / len(rewards)},
                "rewards": {"calc": rewards},
            }
        )
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_async_and_sync_are_compared_at_the_samples_both_reached(tmp_path: Path) -> None:
    start = [0.0, 1.0, 0.0, 1.0]
    a = _run_dir(
        tmp_path / "a",
        "async",
        [(0, 0, 0, start), (10, 480, 60, [1.0, 1.0, 0.0, 1.0]), (20, 960, 120, [1.0] * 4)],
    )
    s = _run_dir(tmp_path / "s", "sync", [(0, 0, 0, start), (10, 480, 170, [0.0, 1.0, 0.0, 1.0])])
    out = subprocess.run(
        [sys.executable, str(ROOT / "ops/bench/learning.py"), str(a), str(s)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    summary = json.loads(out.strip().splitlines()[-1])
    eq = summary["equal_samples"]
    # sync reached 480 samples only: async is read at 480 too, not at its last point
    assert eq["samples"] == {"async": 480, "sync": 480}
    assert eq["seconds"] == {"async": 60.0, "sync": 170.0}
    assert eq["tasks"]["calc"]["async"][0] == pytest.approx(0.75)
    assert eq["tasks"]["calc"]["sync"][0] == pytest.approx(0.5)
    # paired over the same prompts: only prompt 0 differs (+1), so the mean is +0.25
    assert eq["tasks"]["calc"]["diff"][0] == pytest.approx(0.25)
    assert "at equal trained samples" in out


def test_run_directories_or_run_but_not_both(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "ops/bench/learning.py")], capture_output=True, text=True
    )
    assert done.returncode == 2 and "give run directories, or --run" in done.stderr
