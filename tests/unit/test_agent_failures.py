"""One run of user code that misbehaves, on the tiny model's real ``hf`` engine: what fails is
a ``UserCodeError`` (the input's fault) that says what and where, and what would break a job
later (a NaN in a recorded step or in ``Outcome.info``, which PostgreSQL's ``jsonb`` refuses)
fails the sample here instead. Agents: ``tests.support.faulty_agents``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

from rollcall.tasks.agent import AgentSpec
from rollcall.tasks.echo import EchoTask
from rollcall.workers.episode import AgentUsageError
from rollcall.workers.episode import runtime as agent_runtime
from rollcall.workers.episode.chat import chat_for
from rollcall.workers.episode.play import player
from rollcall.workers.episode.runtime import AgentRun
from rollcall.workers.episode.tools import ToolRunner
from rollcall.workers.episode.trajectory import Limits
from rollcall.workers.episode.usercode import UserCodeError

AGENTS = "tests.support.faulty_agents"
FILE = "tests/support/faulty_agents.py"


@pytest.fixture(scope="module")
def tiny_engine() -> Any:
    from rollcall.workers.rollout.engines.hf import HFEngine

    return HFEngine(str(Path(__file__).parents[2] / "workers" / "models" / "tiny"), seed=0)


def _spec(tmp: Path, agent: str, **spec: Any) -> AgentSpec:
    path = tmp / "p.jsonl"
    path.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(8)))
    return AgentSpec.model_validate(
        {"agent": f"{AGENTS}:{agent}", "prompts": {"path": str(path)}, **spec}
    )


def _run(engine: Any, spec: AgentSpec, prompt: dict[str, Any], max_tokens: int = 256) -> Any:
    limits = Limits(max_turns=4, max_tokens_per_turn=8, max_tokens=max_tokens)
    with ToolRunner() as runner:
        return AgentRun(engine, chat_for(engine.tokenizer), spec, prompt, runner, limits).run()


def _fails(engine: Any, spec: AgentSpec, prompt: dict[str, Any]) -> UserCodeError:
    with pytest.raises(UserCodeError) as e:
        _run(engine, spec, prompt)
    return e.value


def test_a_nan_reward_fails_the_sample_naming_the_value_and_the_agent(
    tiny_engine: Any, tmp_path: Path
) -> None:
    e = _fails(tiny_engine, _spec(tmp_path, "nan_on_some"), {"i": 0, "every": 4})
    assert e.message == "the agent's reward nan is not a finite number"
    assert e.location.startswith(f"{FILE}:") and e.location.endswith(" in nan_on_some")
    assert not e.input_independent
    assert _run(tiny_engine, _spec(tmp_path, "nan_on_some"), {"i": 1, "every": 4}).reward >= 0


def test_a_nan_from_a_recorded_step_fails_the_sample_not_the_checkpoint(
    tiny_engine: Any, tmp_path: Path
) -> None:
    # before, json.dumps wrote NaN into the journal and PostgreSQL refused the checkpoint:
    # the node's failure, counted against its breaker
    e = _fails(tiny_engine, _spec(tmp_path, "step_nan"), {"i": 0})
    assert isinstance(e.__cause__, AgentUsageError)
    assert "ctx.step(_nan_judge)" in e.message and "not finite (NaN or infinity)" in e.message
    e = _fails(tiny_engine, _spec(tmp_path, "info_nan"), {"i": 0})
    assert "Outcome.info must be JSON with finite numbers" in e.message


def test_a_wrong_return_type_is_input_independent(tiny_engine: Any, tmp_path: Path) -> None:
    e = _fails(tiny_engine, _spec(tmp_path, "wrong_type"), {"i": 1})
    assert "returned dict, not an Outcome" in e.message
    assert e.input_independent and e.location.endswith(" in wrong_type")


def test_an_agent_awaiting_forever_is_cancelled_where_it_waits(
    tiny_engine: Any, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    e = _fails(tiny_engine, _spec(tmp_path, "waits", episode_timeout_s=1.5), {"i": 0})
    took = time.monotonic() - t0
    assert e.message == (
        "the agent did not finish within 1.5 s (spec.episode_timeout_s) and was cancelled"
    )
    assert e.kind == "timeout" and e.location.endswith(" in waits"), e.location
    assert "asyncio.Event().wait()" in e.trace
    assert took < agent_runtime.CANCEL_GRACE_S + 1.5, took  # cancelled, not abandoned


def test_an_agent_blocking_its_thread_is_abandoned_and_generates_nothing_later(
    tiny_engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_runtime, "CANCEL_GRACE_S", 0.5)
    out = tmp_path / "late"
    spec = _spec(tmp_path, "sleeps_then_calls", episode_timeout_s=1.0)
    engine = _Counting(tiny_engine)
    t0 = time.monotonic()
    with pytest.raises(UserCodeError) as e:
        _run(engine, spec, {"i": 0, "block_s": 4, "out": str(out)})
    assert time.monotonic() - t0 < 3.5  # given up at 1 + 0.5 s, not after the 4 s block
    message, location = e.value.message, e.value.location
    assert "could not be cancelled within 0.5 s more: its thread is blocked in synchronous" in (
        message
    )
    assert location.endswith(" in sleeps_then_calls"), location  # where it is blocked
    deadline = time.monotonic() + 30
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    # the abandoned run woke up later: its model call did not run (cancelled at its await, or
    # refused by the closed context), nothing was generated for it
    assert out.read_text().startswith(("CancelledError", "AgentUsageError")), out.read_text()
    time.sleep(0.5)
    assert engine.calls == 0


class _Counting:
    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0
        self.tokenizer = inner.tokenizer

    @property
    def version(self) -> int:
        return int(self.inner.version)

    def generate(self, requests: Any) -> Any:
        self.calls += 1
        return self.inner.generate(requests)


def test_the_agents_own_timeout_is_its_error_not_the_episode_timeout(
    tiny_engine: Any, tmp_path: Path
) -> None:
    e = _fails(tiny_engine, _spec(tmp_path, "own_timeout", episode_timeout_s=30), {"i": 0})
    assert e.message.startswith("the agent raised TimeoutError"), e.message


def test_a_prompt_too_long_for_its_first_call_says_how_long(
    tiny_engine: Any, tmp_path: Path
) -> None:
    # a 1 MB prompt was quarantined with "its prompt is 0 tokens": the limit was hit before
    # any token was recorded
    spec = _spec(tmp_path, "good")
    out = _run(tiny_engine, spec, {"i": "crate " * 2000}, max_tokens=256)
    assert out.trajectory.token_ids == [] and out.reward == 0.0
    reason = out.trajectory.stop_reason
    assert reason.startswith("limit: the prompt alone is ") and "rollout.max_tokens (256)" in (
        reason
    ), reason
    assert int(reason.split("alone is ")[1].split()[0]) > 2000


class _BadReward(EchoTask):
    name: ClassVar[str] = "echo"

    def __init__(self, value: Any) -> None:
        self.value = value

    def reward(self, spec: Any, prompt: Any, answer: Any, state: Any, turns: int) -> float:
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (float("nan"), "the task's reward nan is not a finite number"),
        (ZeroDivisionError("no answer"), "the task's reward raised ZeroDivisionError: no answer"),
    ],
)
def test_a_plugins_bad_reward_is_the_inputs_fault(
    tiny_engine: Any, value: Any, message: str
) -> None:
    plugin = _BadReward(value)
    spec = plugin.Spec()
    prompt = plugin.prompt(spec, 0)
    with ToolRunner() as runner:
        loop = player(tiny_engine, chat_for(tiny_engine.tokenizer), plugin, spec, prompt, runner,
                      Limits(max_turns=1, max_tokens_per_turn=8))  # fmt: skip
        with pytest.raises(UserCodeError) as e:
            loop.run()
    assert e.value.message == message
    assert e.value.location.endswith(" in reward"), e.value.location


def test_a_plugins_episode_runs_on_the_callers_thread_and_must_not_await(
    tiny_engine: Any,
) -> None:
    """A built-in plugin's adapter runs on the caller's thread with no event loop (it never
    awaits: a thread and a loop per episode cost about a millisecond); one that awaits fails
    the episode with a sentence instead of hanging."""
    import asyncio
    import threading

    plugin = EchoTask()
    spec = plugin.Spec()
    threads: list[threading.Thread] = []

    async def plays(ctx: Any, prompt: dict[str, Any]) -> float:
        threads.append(threading.current_thread())
        return 1.0

    async def awaits(ctx: Any, prompt: dict[str, Any]) -> float:
        await asyncio.sleep(0)
        return 1.0

    chat = chat_for(tiny_engine.tokenizer)
    limits = Limits(max_turns=1, max_tokens_per_turn=8)
    with ToolRunner() as runner:
        run = AgentRun(tiny_engine, chat, spec, plugin.prompt(spec, 0), runner, limits, fn=plays)
        assert run.run().reward == 1.0
        assert threads == [threading.current_thread()]
        run = AgentRun(tiny_engine, chat, spec, plugin.prompt(spec, 0), runner, limits, fn=awaits)
        with pytest.raises(UserCodeError, match="a plugin's adapter must not"):
            run.run()


def test_rollout_preview_shows_a_failing_episode_and_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.conftest import make_cli_runner

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"i": i, "every": 2}) + "\n" for i in range(4)))
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"agent: '{AGENTS}:raise_on_some'\nprompts: {{path: '{prompts}', held_out_per_mille: 0}}\n"
    )
    tiny = str(Path(__file__).parents[2] / "workers" / "models" / "tiny")
    r = make_cli_runner(capsys)(
        "rollout", "preview", "--task", "agent", "--spec", str(spec), "--model", tiny, "-n", "2",
        "--max-tokens-per-turn", "4",
    )  # fmt: skip
    assert r.code == 0, r.err
    assert "episode 0: failed in the task's code" in r.out
    assert "the agent raised RuntimeError: inventory service returned 500 for SKU-0" in r.out
    assert "in check_stock" in r.out and "episode 1: reward" in r.out


def test_a_function_that_cannot_be_called_so_fails_on_every_input(
    tiny_engine: Any, tmp_path: Path
) -> None:
    from rollcall.workers.episode.context import AgentContext

    async def takes_one(ctx: Any) -> None:  # its signature changed after it was checked
        return None

    spec = _spec(tmp_path, "good")
    with ToolRunner() as runner:
        run = AgentRun(tiny_engine, chat_for(tiny_engine.tokenizer), spec, {"i": 0}, runner,
                       Limits())  # fmt: skip
        with pytest.raises(UserCodeError) as e:
            run._play(takes_one, AgentContext(run, [], None, None))
    assert e.value.input_independent and "raised TypeError" in e.value.message


def test_a_cancelled_error_out_of_the_agent_is_its_own_failure(
    tiny_engine: Any, tmp_path: Path
) -> None:
    # it left the node's loop as a BaseException: the episode given back uncounted and the
    # loop thread dead, on every node that claimed the prompt
    e = _fails(tiny_engine, _spec(tmp_path, "lets_cancel_escape"), {"i": 0})
    assert e.message == "the agent raised CancelledError" and not e.input_independent


def test_a_request_the_endpoint_cannot_serve_is_the_agents_400_not_the_nodes_failure(
    tiny_engine: Any, tmp_path: Path
) -> None:
    # it was answered 503 and recorded as the engine's failure: the node's breaker counted it
    out = _run(tiny_engine, _spec(tmp_path, "bad_request"), {"i": 0})
    assert out.reward == 400.0
