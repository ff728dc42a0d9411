"""``longtail``: a timing model of a long-tail, multi-turn agent workload, for benchmarks
(``ops/bench/pipeline.py``). Not a task to learn: its reward is random.

An episode is a job of ``turns`` tool calls. Each turn, the agent calls the ``work`` tool with
a random ``draw`` (the ``timing_model`` engine's calls carry one); the tool sleeps a
heavy-tailed (log-normal) latency, returns an observation of a sampled number of tokens, and
ends the episode after the sampled number of turns. All of it is a pure function of the spec,
the prompt and the draws, so an episode can be checkpointed and resumed, and the benchmark
computes its bounds from the same functions:

- ``planned_turns``: log-uniform in ``turns_min..turns_max`` (drawn at the first call);
- ``tool_latency_s``: log-normal with median ``tool_median_s`` and shape ``tool_sigma``, capped
  at ``tool_cap_s``, in simulated seconds; the tool sleeps ``time_scale`` real seconds each;
- ``observation_tokens``: log-uniform in ``obs_tokens_min..obs_tokens_max``; the observation
  is that many digits (one token each in the tiny model's tokenizer and in most others);
- the prompt carries a document of ``prompt_tokens_min..prompt_tokens_max`` digits;
- ``reward``: 1 or 0, deterministic per prompt and trajectory (a per-prompt success rate).

Several task profiles are several specs of this one plugin (a search-like task with long
observations, a sandbox-like one with slow tools, ...).
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from typing import Any, ClassVar

from pydantic import Field, model_validator

from rollcall.tasks.base import BaseTask, Observation, TaskSpec, Tool, ToolError

TOOL = "work"


class LongtailSpec(TaskSpec):
    max_turns: int = Field(default=64, ge=1, le=256, description="the agent loop's turn cap")
    turns_min: int = Field(default=5, ge=1)
    turns_max: int = Field(default=50, ge=1)
    tool_median_s: float = Field(default=1.0, ge=0, description="simulated seconds")
    tool_sigma: float = Field(default=1.0, ge=0, description="log-normal shape of tool latency")
    tool_cap_s: float = Field(default=30.0, ge=0, description="longest tool call, simulated")
    obs_tokens_min: int = Field(default=40, ge=1)
    obs_tokens_max: int = Field(default=400, ge=1)
    prompt_tokens_min: int = Field(default=300, ge=0)
    prompt_tokens_max: int = Field(default=700, ge=0)
    success_rate_max: float = Field(default=1.0, ge=0, le=1, description="per-prompt success")
    time_scale: float = Field(default=0.02, gt=0, description="real seconds per simulated second")

    @model_validator(mode="after")
    def _ranges(self) -> LongtailSpec:
        for low, high in (
            ("turns_min", "turns_max"),
            ("obs_tokens_min", "obs_tokens_max"),
            ("prompt_tokens_min", "prompt_tokens_max"),
        ):
            if getattr(self, high) < getattr(self, low):
                raise ValueError(f"{high} must be at least {low}")
        if self.turns_max > self.max_turns:
            raise ValueError("max_turns must be at least turns_max (the loop would cut episodes)")
        return self


def _rng(*parts: Any) -> random.Random:
    return random.Random(":".join(str(p) for p in ("longtail", *parts)))


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    if high <= low:
        return low
    return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))


def planned_turns(spec: LongtailSpec, key: int, draw: int) -> int:
    return _log_uniform(_rng(spec.seed, key, draw, "turns"), spec.turns_min, spec.turns_max)


def tool_latency_s(spec: LongtailSpec, key: int, draw: int, turn: int) -> float:
    """Simulated seconds of the ``turn``-th call (0-based)."""
    if spec.tool_median_s <= 0:
        return 0.0
    z = _rng(spec.seed, key, draw, turn, "latency").gauss(0.0, 1.0)
    return min(spec.tool_cap_s, spec.tool_median_s * math.exp(spec.tool_sigma * z))


def observation_tokens(spec: LongtailSpec, key: int, draw: int, turn: int) -> int:
    rng = _rng(spec.seed, key, draw, turn, "obs")
    return _log_uniform(rng, spec.obs_tokens_min, spec.obs_tokens_max)


def prompt_tokens(spec: LongtailSpec, key: int) -> int:
    rng = _rng(spec.seed, key, "prompt")
    return rng.randint(spec.prompt_tokens_min, spec.prompt_tokens_max)


def digits(n: int, *seed: Any) -> str:
    rng = _rng(*seed, "digits")
    return "".join(rng.choice("0123456789") for _ in range(n))


def _unit(*parts: Any) -> float:
    h = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "little") / 2**64


class LongtailTask(BaseTask):
    name: ClassVar[str] = "longtail"
    description: ClassVar[str] = (
        "Benchmark timing model: multi-turn jobs of 5-50 tool calls with heavy-tailed latency "
        "(ops/bench/pipeline.py); the reward is random."
    )
    Spec: ClassVar[type[TaskSpec]] = LongtailSpec
    # the tool reads it (call_tool); nothing else of the prompt row reaches the tool
    tool_prompt_fields: ClassVar[tuple[str, ...]] = ("key",)
    sleep: ClassVar[Any] = time.sleep

    def _prompt(self, spec: TaskSpec, stream: str, index: int) -> dict[str, Any]:
        key = int(_unit("key", stream, spec.seed, index) * 2**62)
        return {"index": index, "key": key, **({"held_out": True} if stream == "eval" else {})}

    def prompt(self, spec: TaskSpec, index: int) -> dict[str, Any]:
        return self._prompt(spec, "train", index)

    def eval_prompt(self, spec: TaskSpec, index: int) -> dict[str, Any]:
        return self._prompt(spec, "eval", index)

    def instructions(self, spec: TaskSpec, prompt: dict[str, Any]) -> str:
        assert isinstance(spec, LongtailSpec)
        key = int(prompt["key"])
        doc = digits(prompt_tokens(spec, key), spec.seed, key)
        return f"Job {prompt['index']}: call {TOOL} until it says done. Input:\n{doc}"

    def tools(self, spec: TaskSpec) -> list[Tool]:
        return [
            Tool(
                name=TOOL,
                description="Do one step of the job; says done after the last one.",
                parameters={
                    "type": "object",
                    "properties": {"draw": {"type": "integer"}, "pad": {"type": "string"}},
                    "required": ["draw"],
                },
            )
        ]

    def initial_state(self, spec: TaskSpec, prompt: dict[str, Any]) -> dict[str, Any]:
        return {"turns": 0, "planned": 0, "trace": 0}

    def call_tool(
        self,
        spec: TaskSpec,
        prompt: dict[str, Any],
        state: dict[str, Any],
        name: str,
        arguments: dict[str, Any],
    ) -> Observation:
        assert isinstance(spec, LongtailSpec)
        if name != TOOL:
            return super().call_tool(spec, prompt, state, name, arguments)
        draw = arguments.get("draw")
        if not isinstance(draw, int) or isinstance(draw, bool):
            raise ToolError("argument 'draw' must be an integer")
        key = int(prompt["key"])
        turn = int(state.get("turns", 0))
        planned = int(state.get("planned") or 0) or planned_turns(spec, key, draw)
        self.sleep(tool_latency_s(spec, key, draw, turn) * spec.time_scale)
        n = observation_tokens(spec, key, draw, turn)
        new_state = {
            "turns": turn + 1,
            "planned": planned,
            "trace": (int(state.get("trace", 0)) * 1_000_003 + draw) % 2**61,
        }
        done = turn + 1 >= planned
        text = f"{'done' if done else 'ok'} {turn + 1}/{planned}\n{digits(n, key, draw, turn)}"
        return Observation(text, new_state, done=done)

    def reward(
        self,
        spec: TaskSpec,
        prompt: dict[str, Any],
        answer: str | None,
        state: dict[str, Any],
        turns: int,
    ) -> float:
        assert isinstance(spec, LongtailSpec)
        rate = spec.success_rate_max * _unit("rate", spec.seed, prompt["key"])
        return 1.0 if _unit("reward", prompt["key"], state.get("trace", 0)) < rate else 0.0
