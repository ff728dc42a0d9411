"""The shipped tiny model: what ``rollcall model init`` builds, copied in on first use.

A build is deterministic (one thread, deterministic kernels), whatever thread count the caller
runs with, so the shipped bytes are reproducible by the command (``ops/tiny_model.py --check``
rebuilds the full one; here two small builds are compared)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from rollcall.orchestrator.cli.model import init
from rollcall.orchestrator.cli.run import resolve_model
from rollcall.orchestrator.config import RollcallConfig, load_config
from rollcall.workers import tiny_model
from rollcall.workers.tiny_model import SHIPPED, file_digests, install_shipped, shipped_build


def _small_build(out: Path, threads: int) -> dict[str, str]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        init(out=out, steps=4, copy_steps=4, eval_episodes=0)
    finally:
        torch.set_num_threads(before)
    assert torch.get_num_threads() == before
    return file_digests(out)


def test_a_build_gives_the_same_bytes_whatever_the_thread_count(tmp_path: Path) -> None:
    one = _small_build(tmp_path / "one", threads=1)
    two = _small_build(tmp_path / "two", threads=2)
    assert set(one) >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert one == two


def test_the_shipped_model_matches_its_build_record() -> None:
    build = shipped_build()
    assert build is not None, f"no shipped tiny model in {SHIPPED} (python ops/tiny_model.py)"
    assert file_digests(SHIPPED) == build["files"]
    assert build["command"].startswith("rollcall model init --out DIR")
    config = json.loads((SHIPPED / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    # the starting reward of every task the quickstart trains was measured on held-out prompts
    quickstart = load_config(Path("configs/quickstart.yaml"))
    assert {t.plugin for t in quickstart.tasks} <= set(build["starting_reward"])


def test_a_first_run_copies_the_shipped_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rollcall.orchestrator.cli.model as model_cli

    def no_build(**_: Any) -> None:
        raise AssertionError("built the tiny model although a build is shipped")

    monkeypatch.setattr(model_cli, "init", no_build)
    cfg = RollcallConfig.model_validate(
        {"job": {"name": "t"}, "tasks": [{"name": "echo", "plugin": "echo"}]}
    )
    path = resolve_model(cfg, tmp_path, Console(file=None))
    assert path == tmp_path / "models" / "tiny"
    assert file_digests(path) == file_digests(SHIPPED)
    assert not list((tmp_path / "models").glob(".*tmp"))  # nothing left aside


def test_a_damaged_shipped_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copy = tmp_path / "shipped"
    shutil.copytree(SHIPPED, copy)
    (copy / "config.json").write_text((copy / "config.json").read_text() + " ")
    monkeypatch.setattr(tiny_model, "SHIPPED", copy)
    with pytest.raises(ValueError, match=r"does not match BUILD\.json.*config\.json"):
        install_shipped(tmp_path / "home" / "tiny")
    assert not (tmp_path / "home" / "tiny").exists()
