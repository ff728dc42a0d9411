"""A built wheel works outside the clone (issue 57): the wheel built from this tree, installed
with ``--no-deps`` into a folder of its own (on top of this environment's torch, Ray and
SQLAlchemy: nothing is installed twice), run from another directory, has its shipped configs
(``rollcall config list|show``) and its quickstart finds its config, the tiny model and the
migrations in the installed package, not in a source tree.

The quickstart stops cheaply here: ``--resume`` of a job that does not exist is refused right
after the config is loaded, the tiny model copied into the home and the schema checked, before
Ray starts (a whole 2-step quickstart from the wheel, done by hand: minutes on a loaded machine).
Seconds in all: the wheel is built and installed with pip, offline, without build isolation."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import short_tmpdir

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
# What the wheel is built from (pyproject's readme: README.md); rollcall/ holds links to the rest
SOURCES = (
    "pyproject.toml", "README.md", "rollcall", "orchestrator", "workers", "tasks", "migrations",
    "configs",
)  # fmt: skip
PIP = (sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-cache-dir")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of the tree (a build writes build/ and *.egg-info beside
    the sources: not in the checkout), installed with ``--no-deps --target``."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            ignore = shutil.ignore_patterns("__pycache__")
            shutil.copytree(path, src / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    dist = tmp / "dist"
    build = [*PIP, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist), "."]
    r = subprocess.run(build, cwd=src, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = dist.glob("rollcall-*.whl")
    site = tmp / "site"
    install = [*PIP, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)]
    r = subprocess.run(install, cwd=tmp, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    return site


@pytest.fixture
def home() -> Iterator[Path]:
    h = short_tmpdir("rc-whl-")
    yield h
    shutil.rmtree(h, ignore_errors=True)


def _run(site: Path, home: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The installed console script, ``rollcall ARGS``, in ``cwd`` (not the checkout), with the
    installed folder alone on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("ROLLCALL_DATABASE_URL", "PYTHONPATH")}
    env |= {"PYTHONPATH": str(site), "ROLLCALL_HOME": str(home), "COLUMNS": "200"}
    return subprocess.run(
        [str(site / "bin" / "rollcall"), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def test_the_installed_wheel_runs_from_another_directory(
    site: Path, home: Path, tmp_path: Path, db_url: str
) -> None:
    # the installed package is the one imported, not the checkout's editable install
    probe = "import rollcall, rollcall.orchestrator.cli as c; print(rollcall.__file__, c.__file__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    r = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    for file in r.stdout.split():
        assert Path(file).is_relative_to(site), r.stdout
    assert not (site / "rollcall" / "configs").is_symlink()  # the files themselves

    # the shipped configs: listed, printed as they are, each a config that loads
    r = _run(site, home, tmp_path, "config", "list")
    assert r.returncode == 0, r.stderr
    listed = dict(line.split() for line in r.stdout.splitlines())
    names = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    assert sorted(listed) == names
    assert all(Path(p).is_relative_to(site / "rollcall" / "configs") for p in listed.values())
    r = _run(site, home, tmp_path, "config", "show", "quickstart")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (ROOT / "configs" / "quickstart.yaml").read_text()
    assert yaml.safe_load(r.stdout)["job"]["name"] == "quickstart"
    # (an unknown name, what show prints loaded as a config: tests/unit/test_config_command.py)

    # the quickstart: its config, the tiny model and the schema from the installed package
    r = _run(
        site, home, tmp_path, "--database-url", db_url,
        "quickstart", "run.total_steps=2", "--resume", "--no-live",
    )  # fmt: skip
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [
        "error: job 'quickstart' does not exist, so there is nothing to resume; drop --resume to "
        "start it"
    ], r.stdout + r.stderr
    assert f"tiny model: the shipped build, copied to {home}/models/tiny" in r.stdout, r.stdout
    assert (home / "models" / "tiny" / "model.safetensors").is_file()
