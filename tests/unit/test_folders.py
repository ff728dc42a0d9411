"""``replace_folder``: a folder is written whole or not at all."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from rollcall.orchestrator.folders import replace_folder


def _write(text: str) -> Callable[[Path], None]:
    def fill(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "f").write_text(text)

    return fill


def test_a_new_folder_replaces_the_old_one_and_nothing_is_left_beside_it(tmp_path: Path) -> None:
    path = tmp_path / "model"
    replace_folder(path, _write("one"))
    (path / "stale").write_text("from the first build")
    assert replace_folder(path, _write("two")) == path
    assert sorted(p.name for p in path.iterdir()) == ["f"]
    assert (path / "f").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_failed_fill_leaves_the_previous_folder_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "model"
    replace_folder(path, _write("one"))

    def broken(tmp: Path) -> None:
        _write("half")(tmp)
        raise RuntimeError("the build died")

    with pytest.raises(RuntimeError, match="the build died"):
        replace_folder(path, broken)
    assert (path / "f").read_text() == "one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_failed_first_fill_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "model"

    def broken(tmp: Path) -> None:
        tmp.mkdir()
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        replace_folder(path, broken)
    assert not path.exists()
    assert list((tmp_path / "sub").iterdir()) == []
