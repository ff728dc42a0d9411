"""``ops/bench/lora.py`` runs and its figures say what LoRA promises on the tiny model: a small
share of the parameters train, the optimizer state and a published version shrink with them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_lora_trains_publishes_and_keeps_less_than_full(tiny_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny").symlink_to(tiny_dir)
    out = subprocess.run(
        [sys.executable, str(ROOT / "ops/bench/lora.py"), "--models", "tiny", "--rank", "4"],
        capture_output=True, text=True, timeout=300, check=True,
        env={**os.environ, "ROLLCALL_HOME": str(tmp_path)},
    )  # fmt: skip
    full, lora = json.loads(out.stdout.strip().splitlines()[-1])["rows"]
    assert (full["mode"], lora["mode"]) == ("full", "lora r4")
    assert full["trainable"] == full["parameters"] and lora["trainable"] < full["trainable"] / 10
    # AdamW keeps two float32 moments per trained parameter
    assert full["optimizer_bytes"] == 8 * full["trainable"]
    assert lora["optimizer_bytes"] == 8 * lora["trainable"]
    assert lora["file"] == "adapter_model.safetensors"
    assert 4 * lora["trainable"] < lora["publish_bytes"] < full["publish_bytes"] / 5
