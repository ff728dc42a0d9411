"""A rollout node validates an agent task's spec once, not at every claim: validating reads the
file system (the agent's file, the prompt files), ``rollcall.tasks.agent.validated_once``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from rollcall.tasks.agent import AgentSpec, validated_once

AGENT = """
async def rollout(ctx, prompt):
    return 1.0
"""


def _stored_spec(tmp: Path) -> dict[str, object]:
    """A spec as the database holds it: validated at registration, its paths resolved."""
    (tmp / "agent.py").write_text(AGENT)
    (tmp / "p.jsonl").write_text("".join(json.dumps({"q": i}) + "\n" for i in range(20)))
    data = {"agent": f"{tmp / 'agent.py'}:rollout", "prompts": {"path": str(tmp / "p.jsonl")}}
    return AgentSpec.model_validate(data).model_dump(mode="json")


def test_a_spec_is_validated_once_per_process(tmp_path: Path) -> None:
    data = _stored_spec(tmp_path)
    first = validated_once(AgentSpec, data)
    shutil.rmtree(tmp_path)  # validating again would fail: its files are gone
    assert validated_once(AgentSpec, dict(data)) is first
    with pytest.raises(ValidationError, match="no such file"):
        AgentSpec.model_validate(data)  # as registration validates: each time


def test_a_spec_that_fails_is_not_kept(tmp_path: Path) -> None:
    data = _stored_spec(tmp_path)
    (tmp_path / "p.jsonl").unlink()
    for _ in range(2):
        with pytest.raises(ValidationError, match="no such file"):
            validated_once(AgentSpec, data)
    (tmp_path / "p.jsonl").write_text(json.dumps({"q": 1}) + "\n" + json.dumps({"q": 2}) + "\n")
    spec = validated_once(AgentSpec, data)
    assert isinstance(spec, AgentSpec) and spec.agent == data["agent"]
