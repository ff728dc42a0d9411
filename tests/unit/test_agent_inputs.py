"""Agent tasks' bad input, refused with one sentence (a missing module or function, a function
of the wrong shape, a prompt file with a bad row), prompt sources (JSONL, Parquet, a glob, a
``datasets`` folder) and tools that raise or hang, on the tiny model's real ``hf`` engine."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from rollcall.tasks.agent import AgentSpec, AgentTask, PromptSource, prompt_rows
from rollcall.workers.episode import AgentUsageError
from rollcall.workers.episode.chat import chat_for
from rollcall.workers.episode.runtime import AgentRun
from rollcall.workers.episode.tools import ToolRunner
from rollcall.workers.episode.trajectory import Limits
from rollcall.workers.episode.usercode import UserCodeError

AGENTS = "tests.support.agents"


def _prompts(tmp: Path, n: int = 30) -> Path:
    path = tmp / "p.jsonl"
    path.write_text("".join(json.dumps({"q": f"question {i}"}) + "\n" for i in range(n)))
    return path


def _spec(agent: str, prompts: Any) -> AgentSpec:
    return AgentSpec.model_validate({"agent": agent, "prompts": prompts})


@pytest.mark.parametrize(
    ("agent", "message"),
    [
        (
            "no_such_module:rollout",
            "agent 'no_such_module:rollout': no module named 'no_such_module'",
        ),
        (f"{AGENTS}:missing", f"agent '{AGENTS}:missing': {AGENTS} has no function 'missing'"),
        (f"{AGENTS}:not_async", "must be an async function, 'async def not_async(ctx, prompt)'"),
        (f"{AGENTS}:one_argument", "must take two arguments (ctx, prompt); it takes (ctx)"),
        ("rollout", "must be 'package.module:function' or 'path/to/file.py:function'"),
        ("/nowhere/agent.py:rollout", "no such file /nowhere/agent.py"),
    ],
)
def test_a_bad_agent_is_refused_with_one_sentence(tmp_path: Path, agent: str, message: str) -> None:
    with pytest.raises(ValueError) as e:
        _spec(agent, {"path": str(_prompts(tmp_path))})
    assert message in str(e.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"q": 1}\n{"q": \n', "line 2 is not JSON"),
        ('{"q": 1}\n[1, 2]\n', "line 2 is a JSON list, not an object"),
    ],
)
def test_a_prompt_file_with_a_bad_row_is_refused(tmp_path: Path, text: str, message: str) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(text)
    with pytest.raises(ValueError, match=message):
        _spec(f"{AGENTS}:steady", {"path": str(bad)})
    with pytest.raises(ValueError, match="no such file"):
        _spec(f"{AGENTS}:steady", {"path": str(tmp_path / "none.jsonl")})
    with pytest.raises(ValueError, match="has no key column 'question'"):
        _spec(f"{AGENTS}:steady", {"path": str(_prompts(tmp_path)), "key": "question"})


def test_prompt_sources_are_deterministic_and_split_by_key(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"q": f"question {i}", "answer": i} for i in range(200)]
    (tmp_path / "a").mkdir()
    for part in range(2):
        chunk = rows[part * 100 : (part + 1) * 100]
        (tmp_path / "a" / f"part{part}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in chunk)
        )
        pq.write_table(pa.Table.from_pylist(chunk), tmp_path / "a" / f"part{part}.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))

    sources = [
        PromptSource(path=str(tmp_path / "a" / "*.jsonl"), key="q"),
        PromptSource(path=str(tmp_path / "a" / "*.parquet"), key="q"),
        PromptSource(dataset=str(tmp_path / "ds"), key="q"),
    ]
    splits = [prompt_rows(s) for s in sources]
    assert splits[0] == splits[1] == splits[2]
    train, held = splits[0]
    assert len(train) + len(held) == 200 and 5 <= len(held) <= 40
    assert not {r["q"] for r in train} & {r["q"] for r in held}
    task = AgentTask()
    spec = _spec(f"{AGENTS}:steady", {"path": str(tmp_path / "a" / "*.parquet"), "key": "q"})
    stream = [task.prompt(spec, i) for i in range(len(train) + 3)]
    assert stream[: len(train)] == train and stream[len(train) :] == train[:3]  # by index
    assert [task.eval_prompt(spec, i) for i in range(3)] == held[:3]


@pytest.fixture(scope="module")
def tiny_engine() -> Any:
    from rollcall.workers.rollout.engines.hf import HFEngine

    return HFEngine(str(Path(__file__).parents[2] / "workers" / "models" / "tiny"), seed=0)


def _play(engine: Any, tmp: Path, prompt: dict[str, Any], agent: str = "tool_user") -> Any:
    spec = _spec(f"{AGENTS}:{agent}", {"path": str(_prompts(tmp))})
    limits = Limits(max_turns=4, max_tokens_per_turn=8, max_tokens=256)
    with ToolRunner() as runner:
        run = AgentRun(engine, chat_for(engine.tokenizer), spec, prompt, runner, limits)
        return run.run()


def test_a_tool_that_raises_becomes_an_observation_or_fails_the_episode(
    tiny_engine: Any, tmp_path: Path
) -> None:
    out = _play(tiny_engine, tmp_path, {"tool": "raising"})
    assert out.trajectory.state["info"]["observation"] == (
        "error: ValueError: cannot evaluate '6 * 7'"
    )
    # the episode fails as its input's fault, the agent's exception its cause
    with pytest.raises(UserCodeError, match="the tool 'calc' failed: ValueError: cannot") as e:
        _play(tiny_engine, tmp_path, {"tool": "raising", "options": {"on_error": "raise"}})
    assert isinstance(e.value.__cause__, AgentUsageError)
    assert e.value.location.endswith("in tool_user"), e.value.location
    ok = _play(tiny_engine, tmp_path, {"tool": "answer"})
    assert ok.trajectory.state["info"]["observation"] == "42"
    assert [e["k"] for e in ok.trajectory.state["journal"]] == ["chat", "tool"]


@pytest.mark.parametrize("isolate", [False, True])
def test_a_tool_that_hangs_times_out_and_the_agent_goes_on(
    tiny_engine: Any, tmp_path: Path, isolate: bool
) -> None:
    t0 = time.monotonic()
    out = _play(
        tiny_engine,
        tmp_path,
        {"tool": "hanging", "options": {"timeout_s": 1.0, "isolate": isolate}},
    )
    assert out.trajectory.state["info"]["observation"] == (
        "error: the tool 'calc' did not answer within 1 s"
    )
    assert out.trajectory.stop_reason == "returned"
    assert time.monotonic() - t0 < 60


def test_a_trained_conversation_must_be_extended_not_rewritten(
    tiny_engine: Any, tmp_path: Path
) -> None:
    with pytest.raises(UserCodeError, match="message 0 differs from the trained conversation") as e:
        _play(tiny_engine, tmp_path, {}, agent="rewriter")
    assert isinstance(e.value.__cause__, AgentUsageError)
