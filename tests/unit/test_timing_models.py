"""The benchmark's timing models: the ``timing_model`` engine, the ``longtail`` task and the
timing-model trainer. Their outputs are deterministic for a seed, their turns are well-formed
tool calls, and the durations they sleep follow the profile (checked against the formulas,
with a recording sleep instead of a real one)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from rollcall.orchestrator.config import TimingEngineConfig, TimingTrainerConfig, load_config
from rollcall.tasks import registry
from rollcall.tasks.longtail import (
    LongtailSpec,
    LongtailTask,
    observation_tokens,
    planned_turns,
    tool_latency_s,
)
from rollcall.workers.episode.chat import ParsedCall, chat_for, parse_turn
from rollcall.workers.episode.engine import GenerationRequest
from rollcall.workers.episode.play import player
from rollcall.workers.episode.tools import ToolResult, ToolRunner
from rollcall.workers.episode.trajectory import Limits
from rollcall.workers.rollout.engines.timing import TimingEngine
from rollcall.workers.trainer.batch import TrainSequence
from rollcall.workers.trainer.timing import TimingTrainerRank, step_seconds


class Sleeps(list[float]):
    """A sleep that records instead of sleeping."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def engine(tiny_dir: Path, sleeps: Sleeps, seed: int = 0, **overrides: Any) -> TimingEngine:
    return TimingEngine(TimingEngineConfig(**overrides), tiny_dir, seed=seed, sleep=sleeps)


# -- the engine -----------------------------------------------------------------------------


def test_turns_are_well_formed_tool_calls_of_the_drawn_length(tiny_dir: Path) -> None:
    e = engine(tiny_dir, Sleeps(), turn_tokens_min=40, turn_tokens_max=200)
    lengths = []
    for i in range(50):
        g = e.generate([GenerationRequest([1, 2, 3, i], max_new_tokens=512)])[0]
        assert g.finish_reason == "stop" and g.token_ids[-1] == e.tokenizer.eos_token_id
        call = parse_turn(e.tokenizer.decode(g.token_ids))
        assert isinstance(call, ParsedCall) and call.name == "work"
        assert isinstance(call.arguments["draw"], int) and set(call.arguments["pad"]) <= {"0"}
        assert g.logprobs == [-0.7] * len(g.token_ids)
        lengths.append(len(g.token_ids))
    # the shortest call is about 30 tokens, so every drawn length in 40..200 is exact
    assert min(lengths) >= 40 and max(lengths) <= 200
    assert len(set(lengths)) > 20  # drawn, not fixed


def test_a_short_budget_cuts_the_call(tiny_dir: Path) -> None:
    e = engine(tiny_dir, Sleeps())
    g = e.generate([GenerationRequest([1, 2, 3], max_new_tokens=7)])[0]
    assert len(g.token_ids) == 7 and g.finish_reason == "length"


def test_same_seed_same_generations(tiny_dir: Path) -> None:
    def run(seed: int) -> list[list[int]]:
        e = engine(tiny_dir, Sleeps(), seed=seed)
        return [e.generate([GenerationRequest([5, i], 512)])[0].token_ids for i in range(5)]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_time_is_prefill_of_uncached_tokens_plus_decode(tiny_dir: Path) -> None:
    sleeps = Sleeps()
    e = engine(
        tiny_dir,
        sleeps,
        time_scale=0.5,
        prefill_s_per_token=0.001,
        decode_s_per_token=0.02,
        prefix_cache_entries=16,
    )
    prompt = list(range(100, 400))  # 300 tokens, none cached yet
    g1 = e.generate([GenerationRequest(prompt, 512)])[0]
    assert g1.cached_tokens == 0
    assert sleeps[-1] == pytest.approx((300 * 0.001 + len(g1.token_ids) * 0.02) * 0.5)
    # another sample of the same prompt: the whole context is cached
    g2 = e.generate([GenerationRequest(prompt, 512)])[0]
    assert g2.cached_tokens == 300
    assert sleeps[-1] == pytest.approx(len(g2.token_ids) * 0.02 * 0.5)
    # the next turn: context + the generated turn (ends with the end-of-turn token) + a tool
    # observation of 25 tokens; only the observation is prefilled
    context = [*prompt, *g1.token_ids, *range(7, 32)]
    g3 = e.generate([GenerationRequest(context, 512)])[0]
    assert g3.cached_tokens == len(prompt) + len(g1.token_ids)
    assert sleeps[-1] == pytest.approx((25 * 0.001 + len(g3.token_ids) * 0.02) * 0.5)
    assert e.modelled_s == pytest.approx(sum(sleeps) / 0.5)


def test_decode_slows_with_requests_in_flight(tiny_dir: Path) -> None:
    sleeps = Sleeps()
    e = engine(tiny_dir, sleeps, decode_batch_slope=0.1, prefill_s_per_token=0.0)
    gens = e.generate([GenerationRequest([9, i], 512) for i in range(4)])
    longest = max(len(g.token_ids) for g in gens)
    # one batch of 4: the longest output's decode steps, each 1 + 0.1 x 3 slower
    assert sleeps == [pytest.approx(longest * 0.02 * 1.3 * 0.02)]


def test_loading_weights_reads_the_file_and_clears_the_cache(
    tiny_dir: Path, tmp_path: Path
) -> None:
    sleeps = Sleeps()
    e = engine(tiny_dir, sleeps, load_s=2.0, time_scale=0.1)
    prompt = list(range(50))
    e.generate([GenerationRequest(prompt, 512)])
    (tmp_path / "v000001").mkdir()
    (tmp_path / "v000001" / "model.safetensors").write_bytes(b"x" * 1000)
    e.load_weights(1, str(tmp_path / "v000001"))
    assert e.version == 1 and sleeps[-1] == pytest.approx(0.2)
    g = e.generate([GenerationRequest(prompt, 512)])[0]
    assert g.cached_tokens == 0 and g.version == 1  # computed with the old weights: dropped
    with pytest.raises(OSError):
        e.load_weights(2, str(tmp_path / "v000002"))  # pruned meanwhile: the node retries


def test_engine_config_is_named_and_validated(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  engine: {kind: timing_model, time_scale: 0.01}\n")
    cfg = load_config(p)
    assert isinstance(cfg.rollout.engine, TimingEngineConfig)
    with pytest.raises(ValidationError, match="turn_tokens_max must be at least"):
        TimingEngineConfig(turn_tokens_min=50, turn_tokens_max=10)


def test_the_timing_engine_imports_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys; import rollcall.workers.rollout.engines.timing, rollcall.workers.rollout.node, "
        "rollcall.workers.trainer.timing, rollcall.tasks.longtail; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- the task -----------------------------------------------------------------------------------


def test_longtail_is_a_registered_benchmark_plugin() -> None:
    info = registry.available()["longtail"]
    assert info.source == "benchmark"
    assert isinstance(registry.get("longtail"), LongtailTask)


def test_the_profile_is_deterministic_and_within_its_ranges() -> None:
    spec = LongtailSpec(turns_min=5, turns_max=50, obs_tokens_min=40, obs_tokens_max=400)
    turns = [planned_turns(spec, k, 7) for k in range(2000)]
    assert turns == [planned_turns(spec, k, 7) for k in range(2000)]
    assert min(turns) == 5 and max(turns) == 50
    # log-uniform on [5, 51): the median is sqrt(5 * 51) = 16, the mean (51-5)/ln(51/5) = 19.8
    assert 14 <= statistics.median(turns) <= 18
    assert 18 <= statistics.mean(turns) <= 21.5
    obs = [observation_tokens(spec, k, 1, 0) for k in range(2000)]
    assert min(obs) >= 40 and max(obs) <= 400


def test_tool_latency_is_heavy_tailed_log_normal() -> None:
    spec = LongtailSpec(tool_median_s=2.0, tool_sigma=1.0, tool_cap_s=1e9)
    lat = sorted(tool_latency_s(spec, 1, d, 0) for d in range(4000))
    median = lat[len(lat) // 2]
    p99 = lat[int(0.99 * len(lat))]
    assert median == pytest.approx(2.0, rel=0.1)
    # log-normal: p99 / median = exp(2.326 sigma) = 10.2; the mean is exp(sigma^2 / 2) = 1.65
    # times the median
    assert p99 / median == pytest.approx(math.exp(2.326), rel=0.2)
    assert statistics.mean(lat) / median == pytest.approx(math.exp(0.5), rel=0.1)
    capped = LongtailSpec(tool_median_s=2.0, tool_sigma=1.0, tool_cap_s=5.0)
    assert max(tool_latency_s(capped, 1, d, 0) for d in range(1000)) == 5.0


def test_an_episode_sleeps_its_latencies_and_ends_after_its_planned_turns() -> None:
    sleeps = Sleeps()

    class Recorded(LongtailTask):
        sleep = staticmethod(sleeps)

    task, spec = Recorded(), LongtailSpec(time_scale=0.25)
    prompt = task.prompt(spec, 3)
    state = task.initial_state(spec, prompt)
    planned = planned_turns(spec, prompt["key"], 11)
    for turn in range(planned):
        obs = task.call_tool(spec, prompt, state, "work", {"draw": 11 + turn, "pad": "00"})
        state = obs.state
        assert sleeps[-1] == pytest.approx(
            tool_latency_s(spec, prompt["key"], 11 + turn, turn) * 0.25
        )
        digits = obs.text.split("\n", 1)[1]
        assert len(digits) == observation_tokens(spec, prompt["key"], 11 + turn, turn)
        assert obs.done == (turn == planned - 1)
    assert state["turns"] == planned  # the plan came from the first call's draw
    reward = task.reward(spec, prompt, None, state, planned)
    assert reward in (0.0, 1.0) and reward == task.reward(spec, prompt, None, state, planned)


def test_spec_validation_names_the_field() -> None:
    with pytest.raises(ValidationError, match="turns_max must be at least turns_min"):
        LongtailSpec(turns_min=10, turns_max=5)
    with pytest.raises(ValidationError, match="max_turns must be at least turns_max"):
        LongtailSpec(turns_max=80, max_turns=64)


def test_training_and_held_out_prompts_differ() -> None:
    task, spec = LongtailTask(), LongtailSpec()
    train = {task.prompt(spec, i)["key"] for i in range(500)}
    held = {task.eval_prompt(spec, i)["key"] for i in range(500)}
    assert len(train) == 500 and not train & held


class InProcess(ToolRunner):
    def call(
        self,
        plugin: Any,
        spec: Any,
        prompt: Any,
        state: Any,
        name: str,
        arguments: Any,
        network: bool = False,
    ) -> ToolResult:
        obs = plugin.call_tool(spec, prompt, state, name, arguments)
        return ToolResult(obs.text, obs.state, obs.done, False)


def test_the_agent_loop_plays_long_tail_episodes_of_the_profile(tiny_dir: Path) -> None:
    """The real agent loop over the timing engine and the task: episodes end after their
    planned turns, with 800-12,000 tokens, the generated tokens trained on."""
    sleeps = Sleeps()

    class Recorded(LongtailTask):
        sleep = staticmethod(sleeps)

    task, spec = Recorded(), LongtailSpec()
    e = engine(tiny_dir, sleeps)
    for i in range(20):
        prompt = task.prompt(spec, i)
        before = e.health().tokens_generated
        chat = chat_for(e.tokenizer)
        out = player(e, chat, task, spec, prompt, InProcess(), Limits(64, 512, 12_000)).run()
        t = out.trajectory
        assert t.stop_reason in ("environment", "token limit")
        if t.stop_reason == "environment":
            assert out.turns == t.state["planned"]
        assert 800 <= len(t.token_ids) <= 12_600  # the limit is checked before each turn
        assert 5 <= out.turns <= 50
        # trained on: exactly the generated tokens; prompt and observations carry mask 0
        assert sum(t.loss_mask) == e.health().tokens_generated - before
        assert all(m == 0 for m in t.loss_mask[: t.prompt_tokens])
        assert all(t.loss_mask[k] == 1 and t.loss_mask[k - 1] == 0 for k in t.turn_offsets)


# -- the trainer ----------------------------------------------------------------------------------


def seq(n: int) -> TrainSequence:
    import numpy as np

    return TrainSequence(
        token_ids=np.zeros(n, dtype=np.int32),
        loss_mask=np.ones(n, dtype=np.uint8),
        behaviour_logprobs=np.zeros(n, dtype=np.float32),
        advantage=0.0,
        scale=1.0,
        task="t",
    )


def test_the_timing_trainer_sleeps_the_modelled_step(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    sleeps = Sleeps()
    cfg = TimingTrainerConfig(
        time_scale=0.1, step_s=2.0, s_per_token=0.001, checkpoint_s=3.0, publish_s=4.0,
        publish_bytes=4096,
    )  # fmt: skip
    rank = TimingTrainerRank(cfg, sleep=sleeps)
    out = rank.train([[[seq(1000), seq(500)], [seq(500)]]])
    assert out["tokens_trained"] == 2000
    assert step_seconds(cfg, 2000) == pytest.approx(4.0)  # 2 + 0.001 x 2000
    assert sleeps == [pytest.approx(0.4)]
    for v in (1, 2, 3, 4):
        loc = rank.publish(str(tmp_path / "weights"), v, keep=2)
    assert sleeps[-1] == pytest.approx(0.4)
    assert load_file(str(Path(loc) / "model.safetensors"))["weights"].nbytes == 4096
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000003", "v000004"]
    ckpt = rank.save_checkpoint(str(tmp_path / "ckpt" / "step-000004"), 4)
    assert rank.load_checkpoint(ckpt) == 4 and sleeps[-1] == pytest.approx(0.3)
    assert rank.modelled_s == pytest.approx(4.0 + 4 * 4.0 + 3.0)


def test_trainer_timing_model_is_selected_by_config(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("trainer:\n  timing_model: {s_per_token: 0.002}\nrun:\n  eval: {episodes: 0}\n")
    cfg = load_config(p)
    assert cfg.trainer.timing_model is not None and cfg.trainer.timing_model.s_per_token == 0.002
    assert cfg.run.eval.episodes == 0  # no evaluator
    assert (
        load_config(tmp_path / "c.yaml", ["trainer.timing_model=null"]).trainer.timing_model is None
    )
