"""Limits on untrusted inputs (``rollout.input_limits``, docs/security.md): a tool's
observation, a model's tool-call arguments, an agent's ``ctx.step`` result, a request to the
agent endpoint and a prompt row, each over its limit, are one sentence for that episode (an
error observation, or the episode's failure), on the tiny model's real ``hf`` engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollcall.orchestrator.inputs import (
    OVERSIZE_KEY,
    arguments_problem,
    bounded_prompt,
    prompt_problem,
)
from rollcall.tasks.agent import AgentSpec
from rollcall.workers.episode import AgentUsageError
from rollcall.workers.episode.chat import chat_for
from rollcall.workers.episode.runtime import AgentRun
from rollcall.workers.episode.tools import ToolRunner
from rollcall.workers.episode.trajectory import Limits
from rollcall.workers.episode.usercode import UserCodeError

AGENTS = "tests.support.agents"


@pytest.fixture(scope="module")
def tiny_engine() -> Any:
    from rollcall.workers.rollout.engines.hf import HFEngine

    return HFEngine(str(Path(__file__).parents[2] / "workers" / "models" / "tiny"), seed=0)


def _play(engine: Any, tmp: Path, agent: str, prompt: dict[str, Any], **limits: Any) -> Any:
    path = tmp / "p.jsonl"
    path.write_text("".join(json.dumps({"q": f"question {i}"}) + "\n" for i in range(30)))
    spec = AgentSpec.model_validate({"agent": f"{AGENTS}:{agent}", "prompts": {"path": str(path)}})
    with ToolRunner() as runner:
        run = AgentRun(
            engine, chat_for(engine.tokenizer), spec, prompt, runner,
            Limits(max_turns=4, max_tokens_per_turn=8, max_tokens=256, **limits),
        )  # fmt: skip
        return run.run()


@pytest.mark.parametrize("isolate", [False, True])
def test_an_observation_over_its_limit_is_an_error_observation(
    tiny_engine: Any, tmp_path: Path, isolate: bool
) -> None:
    out = _play(
        tiny_engine, tmp_path, "tool_user", {"tool": "huge", "options": {"isolate": isolate}}
    )
    observation = out.trajectory.state["info"]["observation"]
    assert observation.startswith("error: the tool's observation is 204,8"), observation[:200]
    assert "over rollout.input_limits.observation_bytes (65,536)" in observation
    assert len(observation) < 300


def test_tool_arguments_over_their_limit_are_refused_before_the_tool_runs(
    tiny_engine: Any, tmp_path: Path
) -> None:
    arguments = {"expression": "9" * 100_000}
    # ``raising`` would answer "ValueError: ..." had it been called
    out = _play(tiny_engine, tmp_path, "tool_user", {"tool": "raising", "arguments": arguments})
    assert out.trajectory.state["info"]["observation"] == (
        "error: the arguments of the call to 'calc' is 100,017 bytes, over "
        "rollout.input_limits.tool_arguments_bytes (65,536)"
    )
    # a plugin's episode: the same sentence (the one check both use), and the tool is not called
    problem = arguments_problem("calc", arguments, 65_536)
    assert problem is not None and "100,017 bytes" in problem
    assert arguments_problem("calc", {"expression": "1"}, 65_536) is None


def test_a_step_result_over_its_limit_fails_the_episode_with_one_sentence(
    tiny_engine: Any, tmp_path: Path
) -> None:
    ok = _play(tiny_engine, tmp_path, "big_step", {"size": 1000})
    assert ok.trajectory.state["info"]["length"] == 1000
    with pytest.raises(UserCodeError) as e:
        _play(tiny_engine, tmp_path, "big_step", {"size": 2_000_000})
    assert isinstance(e.value.__cause__, AgentUsageError)
    assert "ctx.step(_text_of): its result is 2,000,002 bytes, over " in e.value.message
    assert "rollout.input_limits.step_result_bytes (1,048,576)" in e.value.message


@pytest.mark.parametrize("size", [100_000, 20_000_000])
def test_an_endpoint_request_over_its_limit_gets_413_unread(
    tiny_engine: Any, tmp_path: Path, size: int
) -> None:
    """The client reads the answer (not a reset connection) however much it was sending."""
    out = _play(tiny_engine, tmp_path, "posting", {"size": size}, request_body_bytes=65_536)
    status, message = out.trajectory.state["info"]["with_key"]
    assert status == 413, message
    assert message == (
        f"the request body is {size + 47:,} bytes, over "
        "rollout.input_limits.request_body_bytes (65,536)"
    )
    assert out.trajectory.state["info"]["without_key"][0] == 401  # the key first, as before


def test_a_client_that_waits_for_100_continue_is_refused_before_it_sends(
    tiny_engine: Any, tmp_path: Path
) -> None:
    out = _play(tiny_engine, tmp_path, "expecting", {"size": 10_000_000}, request_body_bytes=65_536)
    assert out.trajectory.state["info"]["answer"].startswith(
        "HTTP/1.0 413 "
    ) or out.trajectory.state["info"]["answer"].startswith("HTTP/1.1 413 "), out.trajectory.state[
        "info"
    ]
    assert out.trajectory.state["info"]["sent"] == 0


def test_a_prompt_row_over_its_limit_is_seeded_as_a_marker_and_refused() -> None:
    row = {"question": "z" * 5000}
    assert bounded_prompt(row, 10_000) == row
    assert prompt_problem(row, 10_000) is None
    marker = bounded_prompt(row, 2048)
    assert marker == {OVERSIZE_KEY: {"bytes": 5015, "limit": 2048}}
    assert prompt_problem(marker, 2048) == (
        "the prompt row is 5,015 bytes, over rollout.input_limits.prompt_bytes (2,048)"
    )
    assert prompt_problem(row, 2048) == prompt_problem(marker, 2048)  # seeded before the limit
