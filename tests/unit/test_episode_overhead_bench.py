"""``ops/bench/episode_overhead.py`` runs and says what the hot path promises: a built-in
plugin's turn is one checkpoint (its tool call goes with the next generation's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_plugin_turn_is_one_checkpoint() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "ops/bench/episode_overhead.py"), "--episodes", "3",
         "--turns", "5"],
        capture_output=True, text=True, timeout=240, check=True,
    )  # fmt: skip
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["turns"] == 5 and figures["checkpoints_per_turn"] == 1.0
    assert figures["us_per_turn_p50"] > 0
