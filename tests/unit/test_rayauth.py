"""A local job's Ray token (``rollcall.orchestrator.rayauth``): made once with mode 0600, refused when
others can read it, and the operator's ``RAY_AUTH_MODE=disabled`` said on the terminal."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from rollcall.orchestrator import rayauth
from rollcall.orchestrator.errors import UserError


def test_the_token_is_made_once_private_and_checked(tmp_path: Path) -> None:
    path = rayauth.ensure_token(tmp_path / "home" / "ray_token")
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert rayauth.ensure_token(path).read_text() == token  # kept, not made again
    path.chmod(0o644)
    with pytest.raises(UserError, match=r"is readable by others \(mode 644\); make it private"):
        rayauth.ensure_token(path)
    path.chmod(0o600)
    path.write_text("")
    with pytest.raises(UserError, match="is empty; remove it to have a new one made"):
        rayauth.ensure_token(path)


def test_a_local_job_uses_its_homes_token_unless_the_operator_says_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rayauth, "_refresh", lambda: None)  # this process's Ray is the tests'
    for var in (rayauth.MODE_VAR, rayauth.TOKEN_VAR, rayauth.TOKEN_PATH_VAR, "ROLLCALL_HOME"):
        monkeypatch.delenv(var, raising=False)  # restored after the test
    assert rayauth.configure_local(tmp_path) == ""
    import os

    assert os.environ[rayauth.MODE_VAR] == "token"
    assert os.environ[rayauth.TOKEN_PATH_VAR] == str(tmp_path / "ray_token")
    assert os.environ["ROLLCALL_HOME"] == str(tmp_path.resolve())  # the actors' home
    monkeypatch.setenv(rayauth.TOKEN_PATH_VAR, "/secrets/ray_token")  # the operator's: kept
    assert rayauth.configure_local(tmp_path) == ""
    assert os.environ[rayauth.TOKEN_PATH_VAR] == "/secrets/ray_token"
    monkeypatch.setenv(rayauth.MODE_VAR, "disabled")
    line = rayauth.configure_local(tmp_path)
    assert line.startswith("Ray token authentication is off (RAY_AUTH_MODE=disabled): anyone")
    assert os.environ[rayauth.MODE_VAR] == "disabled"
