"""``rollcall config list|show``: the job configs shipped in the package are the source tree's
``configs/`` (one copy: ``rollcall/configs`` links to it), listed by name and printed as they
are; an unknown name is one sentence and a non-zero exit. The installed wheel's side:
``tests/integration/test_wheel.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rollcall.orchestrator.cli import main
from rollcall.orchestrator.cli.configs import shipped_config, shipped_dir
from rollcall.orchestrator.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
NAMES = sorted(p.stem for p in CONFIGS.glob("*.yaml"))


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_the_shipped_configs_are_the_source_trees_configs_folder() -> None:
    assert (ROOT / "rollcall" / "configs").is_symlink()
    assert shipped_dir().resolve() == CONFIGS.resolve()
    assert shipped_config("quickstart").resolve() == (CONFIGS / "quickstart.yaml").resolve()
    assert shipped_config("quickstart.yaml") == shipped_config("quickstart")


def test_list_names_every_shipped_config(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(capsys, "config", "list")
    assert code == 0, err
    rows = [line.split() for line in out.splitlines()]
    assert [r[0] for r in rows] == NAMES
    assert all(Path(r[1]).resolve() == (CONFIGS / f"{r[0]}.yaml").resolve() for r in rows)
    code, out, err = _cli(capsys, "config", "list", "--json")
    assert code == 0, err
    assert [c["name"] for c in json.loads(out)] == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_show_prints_the_file_as_it_is(capsys: pytest.CaptureFixture[str], name: str) -> None:
    code, out, err = _cli(capsys, "config", "show", name)
    assert code == 0, err
    assert out == (CONFIGS / f"{name}.yaml").read_text()  # comments included
    assert yaml.safe_load(out) == yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())


def test_what_show_prints_is_a_valid_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    _, out, _ = _cli(capsys, "config", "show", "quickstart")
    copy = tmp_path / "mine.yaml"
    copy.write_text(out)
    assert load_config(copy) == load_config(CONFIGS / "quickstart.yaml")


@pytest.mark.parametrize("name", ["nope", "../pyproject", ""])
def test_an_unknown_name_is_one_sentence_and_a_failure(
    capsys: pytest.CaptureFixture[str], name: str
) -> None:
    code, out, err = _cli(capsys, "config", "show", name)
    assert code != 0 and out == ""
    assert err.strip().splitlines() == [
        f"error: no shipped config named {name!r}; the shipped configs: {', '.join(NAMES)}"
    ]
