"""Deterministic evaluation: a seeded request samples the same tokens whatever shares its batch
and whatever ran before it, so two evaluations of one checkpoint give the same rewards; and the
statistics the final summary prints."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from rollcall.orchestrator.evalstats import gains, mean_interval, paired_gain
from rollcall.workers.episode.engine import GenerationRequest
from rollcall.workers.rollout.engines.hf import HFEngine

pytestmark = pytest.mark.slow  # minutes: left out of the fast tier


def _context(engine: HFEngine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text, add_special_tokens=False))


def test_a_seeded_request_samples_the_same_tokens_in_any_batch(tiny_dir: Path) -> None:
    engine = HFEngine(tiny_dir, seed=1)
    mine = GenerationRequest(_context(engine, "<|user|>\nhow many\n<|assistant|>\n"), 24, 1.0, 7)
    alone = engine.generate([mine])[0]
    others = [
        GenerationRequest(_context(engine, f"<|user|>\nq {'x' * i}\n<|assistant|>\n"), 16, 1.0)
        for i in range(1, 5)
    ]
    engine.generate(others)  # the engine's own generator moves on
    in_batch = engine.generate([others[0], mine, *others[1:]])[1]
    fresh = HFEngine(tiny_dir, seed=99).generate([mine])[0]  # another engine seed, no cache
    assert alone.token_ids == in_batch.token_ids == fresh.token_ids
    assert alone.logprobs == pytest.approx(in_batch.logprobs, abs=1e-4)
    # a different request seed samples differently (over a few seeds: not all the same)
    other = {
        tuple(engine.generate([GenerationRequest(mine.prompt_ids, 24, 1.0, s)])[0].token_ids)
        for s in range(8, 12)
    }
    assert other != {tuple(alone.token_ids)}


def test_two_evaluations_of_one_checkpoint_agree(tiny_dir: Path) -> None:
    from rollcall.workers.evaluation import EvalTask, Evaluator

    tasks = [EvalTask("calculator", "calculator", {}), EvalTask("guess", "guess", {})]
    first = Evaluator(str(tiny_dir), seed=3, concurrency=8)
    a = first.evaluate(tasks, 8)
    b = first.evaluate(list(reversed(tasks)), 8)  # other order: other batches
    first.close()
    second = Evaluator(str(tiny_dir), seed=3, concurrency=3)  # other batch sizes
    c = second.evaluate(tasks, 8)
    second.close()
    assert a == b == c
    assert all(len(rs) == 8 for rs in a.values())


def test_intervals_and_paired_gains() -> None:
    iv = mean_interval([0.0, 1.0] * 50)
    assert iv.mean == 0.5 and iv.n == 100
    assert iv.high - iv.mean == pytest.approx(1.959964 * math.sqrt(0.25 * 100 / 99 / 100))
    assert mean_interval([0.3]).low == 0.3
    assert math.isnan(mean_interval([]).mean)
    g = paired_gain([0.0] * 40 + [1.0] * 10, [1.0] * 30 + [0.0] * 10 + [1.0] * 10)
    assert g.mean == pytest.approx(0.6) and g.excludes_zero
    assert not paired_gain([0.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 0.0]).excludes_zero
    with pytest.raises(ValueError, match="differ in length"):
        paired_gain([1.0], [1.0, 0.0])
    evals = [
        {"step": 0, "reward": {"a": 0.25, "b": 0.5}, "rewards": {"a": [0, 0, 0, 1], "b": [1, 0]}},
        {"step": 5, "reward": {"a": 0.75}},  # an old record: means only
        {"step": 9, "reward": {"a": 0.75, "b": 1.0}, "rewards": {"a": [1, 1, 0, 1], "b": [1, 1]}},
    ]
    by_task = {g.task: g for g in gains(evals)}
    assert (by_task["a"].start, by_task["a"].end, by_task["a"].end_step) == (0.25, 0.75, 9)
    assert by_task["a"].gain is not None and by_task["a"].gain.mean == pytest.approx(0.5)
    assert by_task["b"].gain is not None and by_task["b"].gain.mean == pytest.approx(0.5)


def test_the_final_summary_fits_80_columns() -> None:
    from rollcall.orchestrator.cli.run import NEXT_STEPS, summary_lines
    from rollcall.orchestrator.runner.driver import RunResult

    evals = [
        {"step": 0, "reward": {"calculator": 0.1}, "rewards": {"calculator": [0.1, 0.1, 0.0]}},
        {"step": 80, "reward": {"calculator": 0.7}, "rewards": {"calculator": [1.0, 1.0, 0.1]}},
    ]
    result = RunResult(
        "quickstart", "/tmp/r", 80, 80, 512.0, 300.0, 0.6, 3840, {"calculator": 2560}, evals
    )
    lines = summary_lines(result)
    assert len(lines) == 2 and "0.100 -> 0.700" in lines[1] and "2560" in lines[1]
    assert all(len(line) <= 80 for line in [*lines, *("  " + n for n in NEXT_STEPS)])


def test_evaluation_reuses_its_tool_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """One tool process per concurrent episode, not one per episode: 12 episodes at
    concurrency 3 start at most 3. The shipped (warm-started) model, which calls the tool."""
    from rollcall.workers.episode import tools
    from rollcall.workers.evaluation import EvalTask, Evaluator
    from rollcall.workers.tiny_model import SHIPPED

    started: set[int] = set()
    ensure = tools.ToolRunner._ensure

    def counting(self: tools.ToolRunner) -> object:
        conn = ensure(self)
        started.add(self._proc.pid)
        return conn

    monkeypatch.setattr(tools.ToolRunner, "_ensure", counting)
    evaluator = Evaluator(str(SHIPPED), seed=3, concurrency=3)
    try:
        rewards = evaluator.evaluate([EvalTask("calculator", "calculator", {})], 12)
    finally:
        evaluator.close()
    assert len(rewards["calculator"]) == 12
    assert 1 <= len(started) <= 3
