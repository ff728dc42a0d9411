"""A built-in plugin's episodes in the episode runtime (``play_plugin``): token-in/token-out,
masks, behaviour log-probs, tools, limits, resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rollcall.orchestrator.domain import TrajectoryPayload
from rollcall.tasks.base import TaskPlugin, TaskSpec
from rollcall.tasks.calculator import CalculatorSpec, CalculatorTask
from rollcall.tasks.guess import GuessSpec, GuessTask
from rollcall.workers.episode.chat import chat_for
from rollcall.workers.episode.engine import EngineHealth, Generation, GenerationRequest
from rollcall.workers.episode.play import player
from rollcall.workers.episode.runtime import AgentRun
from rollcall.workers.episode.tools import ToolRunner
from rollcall.workers.episode.trajectory import Limits, Trajectory
from rollcall.workers.rollout.engines.hf import HFEngine

BOOKKEEPING = ("journal", "journal_stored", "calls")


def play(
    engine: Any,
    task: TaskPlugin,
    spec: TaskSpec,
    prompt: dict[str, Any],
    runner: ToolRunner,
    limits: Limits | None = None,
) -> AgentRun:
    chat = chat_for(engine.tokenizer)
    return player(engine, chat, task, spec, prompt, runner, limits or Limits(spec.max_turns))


def env(state: dict[str, Any]) -> dict[str, Any]:
    """The plugin's own state of a finished trajectory's (without the runtime's record)."""
    return {k: v for k, v in state.items() if k not in BOOKKEEPING}


@pytest.fixture(scope="session")
def engine(tiny_dir: Path) -> HFEngine:
    return HFEngine(tiny_dir, seed=0)


@pytest.fixture
def runner() -> Any:
    r = ToolRunner(timeout_s=2.0)
    yield r
    r.close()


class RecordingEngine:
    """Wraps the real engine and records every request and generation."""

    def __init__(self, inner: HFEngine) -> None:
        self.inner = inner
        self.tokenizer = inner.tokenizer
        self.calls: list[tuple[list[int], Generation]] = []

    @property
    def version(self) -> int:
        return self.inner.version

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        out = self.inner.generate(requests)
        self.calls += [(list(r.prompt_ids), g) for r, g in zip(requests, out, strict=True)]
        return out

    def load_weights(self, version: int, location: str) -> None:
        self.inner.load_weights(version, location)

    def health(self) -> EngineHealth:
        return self.inner.health()


class ScriptedEngine:
    """A fake engine (named so) that answers with scripted text, to drive the tool paths the
    randomly initialised tiny model would never take. Log-probs are made-up constants."""

    def __init__(self, tokenizer: Any, turns: list[str], version: int = 3) -> None:
        self.tokenizer = tokenizer
        self.turns = list(turns)
        self._version = version

    @property
    def version(self) -> int:
        return self._version

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        text = self.turns.pop(0)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        stop = text.endswith("<|end|>")
        ids = ids[: requests[0].max_new_tokens]
        return [Generation(ids, [-0.5] * len(ids), "stop" if stop else "length", self._version)]

    def load_weights(self, version: int, location: str) -> None:
        self._version = version

    def health(self) -> EngineHealth:
        return EngineHealth(self._version, 0, 0)


def test_token_in_token_out_and_behaviour_logprobs(engine: HFEngine, runner: ToolRunner) -> None:
    rec = RecordingEngine(engine)
    task, spec = CalculatorTask(), CalculatorSpec()
    out = play(
        rec, task, spec, task.prompt(spec, 0), runner, Limits(max_turns=3, max_tokens_per_turn=24)
    ).run()
    t = out.trajectory
    assert t.finished and len(rec.calls) == len(t.turn_offsets) >= 1
    # Every turn after the first started from the KV cache of the previous one (the context
    # it fed: everything up to its last generated token); the log-prob check below covers
    # those turns too.
    for (ctx, gen), (_, nxt) in zip(rec.calls, rec.calls[1:], strict=False):
        assert nxt.cached_tokens >= len(ctx) + len(gen.token_ids) - 1
    for (context, gen), offset in zip(rec.calls, t.turn_offsets, strict=True):
        # Each request's context is the trajectory up to that turn, and the generated tokens
        # sit in the trajectory exactly as produced.
        assert context == t.token_ids[:offset]
        assert t.token_ids[offset : offset + len(gen.token_ids)] == gen.token_ids
        assert t.loss_mask[offset : offset + len(gen.token_ids)] == [1] * len(gen.token_ids)
    assert sum(t.loss_mask) == sum(len(g.token_ids) for _, g in rec.calls)
    assert t.loss_mask[: t.prompt_tokens] == [0] * t.prompt_tokens
    assert t.turn_versions == [engine.version] * len(t.turn_offsets)
    # Behaviour log-probs equal a teacher-forced forward pass (temperature 1) to 1e-4.
    with torch.no_grad():
        logits = engine.model(torch.tensor([t.token_ids])).logits[0].float()  # [T, V]
    lp = torch.log_softmax(logits, dim=-1)
    for i, m in enumerate(t.loss_mask):
        if m:
            assert abs(lp[i - 1, t.token_ids[i]].item() - t.logprobs[i]) < 1e-4
        else:
            assert t.logprobs[i] == 0.0
    payload = t.payload()
    assert payload.num_tokens == len(t.token_ids)


def test_tool_calls_errors_and_answer(engine: HFEngine, runner: ToolRunner) -> None:
    tok = engine.tokenizer
    task, spec = CalculatorTask(), CalculatorSpec()
    prompt = {"question": "What is 6 times 7 minus 2?", "answer": "40"}
    script = [
        '<tool>{"name": "calc", "arguments": {"expression": "6*7-2"}}</tool><|end|>',
        "<tool>{oops}</tool><|end|>",
        '<tool>{"name": "calc", "arguments": {"expression": "__import__(1)"}}</tool><|end|>',
        "<answer>40</answer><|end|>",
    ]
    out = play(ScriptedEngine(tok, script), task, spec, prompt, runner).run()
    text = tok.decode(out.trajectory.token_ids)
    assert "<|tool|>\n40\n" in text
    assert "error: the tool call is not valid JSON" in text
    assert "error: Call is not allowed" in text
    assert out.trajectory.answer == "40" and out.reward == 1.0 and out.turns == 4
    assert out.trajectory.turn_versions == [3, 3, 3, 3]
    assert env(out.trajectory.state) == {"calc_calls": 1}
    # Observation tokens are not trained on; the generated ones are.
    t = out.trajectory
    for start, end in zip(t.turn_offsets, [*t.turn_offsets[1:], len(t.token_ids)], strict=True):
        seg = t.loss_mask[start:end]
        assert seg[0] == 1 and (0 not in seg or seg.index(0) > 0)


def test_environment_end_and_limits(engine: HFEngine, runner: ToolRunner) -> None:
    tok = engine.tokenizer
    task, spec = GuessTask(), GuessSpec()
    won = play(
        ScriptedEngine(tok, ['<tool>{"name": "guess", "arguments": {"number": 50}}</tool><|end|>']),
        task, spec, {"secret": 50}, runner,
    ).run()  # fmt: skip
    assert won.trajectory.stop_reason == "environment" and won.reward == 1.0
    cut = play(
        ScriptedEngine(tok, ["a" * 400, "b" * 400]), task, spec, {"secret": 50}, runner,
        Limits(max_turns=2, max_tokens_per_turn=16),
    ).run()  # fmt: skip
    assert cut.trajectory.stop_reason == "turn limit" and cut.reward == 0.0
    assert "error: the turn was cut off" in tok.decode(cut.trajectory.token_ids)
    assert all(
        len(g) <= 16
        for g in [cut.trajectory.token_ids[o : o + 16] for o in cut.trajectory.turn_offsets]
    )


def test_resume_from_a_checkpoint_keeps_earlier_turns(engine: HFEngine, runner: ToolRunner) -> None:
    tok = engine.tokenizer
    task, spec = GuessTask(), GuessSpec()
    prompt = {"secret": 30}
    turns = [
        '<tool>{"name": "guess", "arguments": {"number": 50}}</tool><|end|>',
        '<tool>{"name": "guess", "arguments": {"number": 25}}</tool><|end|>',
        '<tool>{"name": "guess", "arguments": {"number": 30}}</tool><|end|>',
    ]
    checkpoints: list[TrajectoryPayload] = []
    first = play(ScriptedEngine(tok, turns[:2]), task, spec, prompt, runner)
    with pytest.raises(IndexError):  # the engine "dies" when asked for a third turn
        first.run(on_turn=lambda t: checkpoints.append(t.payload()))
    # one checkpoint a turn, taken after the generation; the tool call went with the next
    assert [len(c.turn_offsets) for c in checkpoints] == [1, 2]
    # The node died after turn 2; its checkpoint (as stored by the buffer) resumes the game:
    # the calls recorded are answered from it, the second guess (not yet checkpointed) runs
    # again, and the third turn is generated.
    ck = checkpoints[-1]
    again = play(ScriptedEngine(tok, turns[2:], version=4), task, spec, prompt, runner)
    out = again.run(resume=ck)
    assert again.stats.replayed == 3 and again.stats.generated == 1
    r = out.trajectory
    n = ck.num_tokens
    assert r.token_ids[:n] == [int(x) for x in ck.token_ids]
    assert r.loss_mask[:n] == [int(x) for x in ck.loss_mask]
    assert r.turn_versions == [3, 3, 4]
    assert env(r.state) == {"guesses": 3, "solved": True}
    assert out.reward == pytest.approx(1 - 0.5 * 2 / 7)
    assert Trajectory.from_payload(r.payload()).token_ids == r.token_ids


HERMES_CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "6 * 7"}}\n</tool_call>'


class CopyCallTask(CalculatorTask):
    """The calculator with a task statement that asks for one given call: SmolLM2-135M seldom
    calls a tool unasked, and this makes its generated turn a Hermes tool call."""

    def instructions(self, spec: Any, prompt: dict[str, Any]) -> str:
        return f"Repeat exactly, with nothing else:\n{HERMES_CALL}"


def test_a_smollm2_hermes_call_is_run_and_its_result_comes_back_as_a_tool_message(
    smollm2_dir: Path, runner: Any
) -> None:
    engine = RecordingEngine(HFEngine(smollm2_dir, seed=0))
    task, spec = CopyCallTask(), CalculatorSpec()
    # one turn: the tool's message and the next header end the trajectory (the turn limit)
    limits = Limits(max_turns=1, max_tokens_per_turn=40, temperature=0.05)
    assert chat_for(engine.tokenizer).format.name == "hermes"
    t = play(engine, task, spec, task.prompt(spec, 0), runner, limits).run().trajectory
    tok = engine.tokenizer
    (context, gen) = engine.calls[0]
    assert context == t.token_ids[: t.prompt_tokens]  # the prompt, rendered by its template
    assert str(tok.decode(t.token_ids[: t.prompt_tokens])).endswith("<|im_start|>assistant\n")
    end = t.prompt_tokens + len(gen.token_ids)
    assert t.token_ids[t.prompt_tokens : end] == gen.token_ids  # kept as generated
    assert tok.decode(gen.token_ids) == HERMES_CALL + "<|im_end|>"
    assert t.loss_mask[t.prompt_tokens : end] == [1] * len(gen.token_ids)
    # the call ran (6 * 7) and its result came back in a tool message, then the next header
    assert (
        tok.decode(t.token_ids[end:]) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    )
    assert t.loss_mask[end:] == [0] * (len(t.token_ids) - end)
    assert t.stop_reason == "turn limit"
