"""The contract every task plugin implements.

A plugin has a registered ``name``, a one-line ``description`` and a ``Spec``: a pydantic model
(``extra="forbid"``) that validates the YAML given to ``rollcall task register --spec``. It
provides:

- a deterministic prompt stream: ``prompt(spec, index)`` is a pure function of the spec and the
  index, so a restart that resumes from a persisted cursor neither repeats nor skips prompts;
  ``eval_prompt(spec, index)`` is a held-out stream, disjoint from the training stream;
- ``instructions``: the task statement the agent sees;
- the tools it offers (name, description, JSON schema of the arguments) and the environment
  step ``call_tool`` that applies one call to a JSON-serialisable state (so a trajectory can be
  checkpointed and resumed) and returns the observation text. Bad arguments raise
  ``ToolError``, whose message becomes the observation; the agent loop runs tools with a
  timeout, so a tool that hangs or crashes never takes the worker down;
- a pure, deterministic ``reward`` of the final answer, the environment state and the number of
  turns used;
- optionally ``read_answer(spec, text)``: how the final answer is read from the model's answer
  text as written (a free-form reply in the Hermes or JSON tool-call formats, the inside of the
  answer tag in the tiny model's). ``BaseTask`` takes the text as written (stripped); a plugin
  without the method gets the same.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field


class TaskSpec(BaseModel):
    """Fields every task spec has; plugins subclass it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    group_size: int = Field(default=4, ge=1, le=1024, description="samples per prompt (GRPO group)")
    seed: int = Field(default=0, description="seed of the prompt stream")
    max_turns: int = Field(default=8, ge=1, le=256, description="model turns per trajectory")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


@dataclass(frozen=True)
class Observation:
    text: str
    state: dict[str, Any] = field(default_factory=dict)  # the environment state after the call
    done: bool = False  # the environment ended the episode (e.g. the game was won)


class ToolError(Exception):
    """A tool call that cannot be applied (unknown tool, bad arguments); the message is shown
    to the model as the observation."""


@runtime_checkable
class Task(Protocol):
    """What every task is: a name, a spec and its prompts. A built-in plugin (``TaskPlugin``)
    adds its tools, environment and reward; an agent task (``rollcall.tasks.agent``) has its
    agent function instead."""

    name: ClassVar[str]
    description: ClassVar[str]
    Spec: ClassVar[type[TaskSpec]]

    def prompt(self, spec: TaskSpec, index: int) -> dict[str, Any]:
        """The ``index``-th training prompt (a JSON-serialisable mapping)."""
        ...

    def eval_prompt(self, spec: TaskSpec, index: int) -> dict[str, Any]:
        """The ``index``-th held-out prompt; never equal to a training prompt."""
        ...

    def instructions(self, spec: TaskSpec, prompt: dict[str, Any]) -> str:
        """The task statement shown to the agent."""
        ...


@runtime_checkable
class TaskPlugin(Task, Protocol):
    """A task played by the plugin adapter (``rollcall.workers.episode.plugin``): the model
    calls its tools on its environment's state, then answers; the reward scores the answer."""

    def tools(self, spec: TaskSpec) -> list[Tool]: ...

    def initial_state(self, spec: TaskSpec, prompt: dict[str, Any]) -> dict[str, Any]: ...

    def call_tool(
        self,
        spec: TaskSpec,
        prompt: dict[str, Any],
        state: dict[str, Any],
        name: str,
        arguments: dict[str, Any],
    ) -> Observation:
        """Apply one tool call; raise ``ToolError`` for a call that cannot be applied."""
        ...

    def reward(
        self,
        spec: TaskSpec,
        prompt: dict[str, Any],
        answer: str | None,
        state: dict[str, Any],
        turns: int,
    ) -> float:
        """Pure, deterministic reward of a finished trajectory."""
        ...


class BaseTask:
    """Defaults for a plugin without tools or environment state.

    ``tool_prompt_fields``: the prompt row's fields that ``call_tool`` sees (default none). The
    tool runs in the sandbox beside code the model wrote, so the rest of the row (the reward's
    label above all) never enters its process: ``call_tool`` gets a ``prompt`` with only these
    keys. A task whose tool needs a field of the row (the guess task's ``secret``) names it.
    """

    tool_prompt_fields: ClassVar[tuple[str, ...]] = ()

    def read_answer(self, spec: TaskSpec, text: str) -> str | None:
        """The final answer in the model's answer text (``None``: no answer in it)."""
        return text.strip() or None

    def tools(self, spec: TaskSpec) -> list[Tool]:
        return []

    def initial_state(self, spec: TaskSpec, prompt: dict[str, Any]) -> dict[str, Any]:
        return {}

    def call_tool(
        self,
        spec: TaskSpec,
        prompt: dict[str, Any],
        state: dict[str, Any],
        name: str,
        arguments: dict[str, Any],
    ) -> Observation:
        known = ", ".join(t.name for t in self.tools(spec)) or "none"
        raise ToolError(f"unknown tool {name!r}; available tools: {known}")


class SplitTask(BaseTask):
    """Training and held-out prompt streams from one generator, split by a canonical key.

    A subclass implements ``draw(spec, rng) -> (key, prompt)``. The ``index``-th prompt of a
    stream is the first draw (from an RNG seeded by task, stream, seed, index and attempt)
    whose key falls in that stream's split, so the streams are deterministic and never share a
    problem."""

    name: ClassVar[str]
    held_out_per_mille: ClassVar[int] = 100

    def draw(self, spec: TaskSpec, rng: random.Random) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def _split(self, spec: TaskSpec, index: int, want_eval: bool) -> dict[str, Any]:
        stream = "eval" if want_eval else "train"
        for attempt in range(10_000):
            rng = random.Random(f"{self.name}:{stream}:{spec.seed}:{index}:{attempt}")
            key, prompt = self.draw(spec, rng)
            if held_out(key, self.held_out_per_mille) == want_eval:
                return {"index": index, **prompt}
        raise RuntimeError(f"no {stream} prompt found for index {index}")  # pragma: no cover

    def prompt(self, spec: TaskSpec, index: int) -> dict[str, Any]:
        return self._split(spec, index, want_eval=False)

    def eval_prompt(self, spec: TaskSpec, index: int) -> dict[str, Any]:
        return self._split(spec, index, want_eval=True)


def held_out(key: str, eval_fraction_per_mille: int = 100) -> bool:
    """Whether a problem (by its canonical key) belongs to the held-out split. Training and
    evaluation streams keep only problems of their own split, so they never overlap."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 1000 < eval_fraction_per_mille


def require_args(arguments: dict[str, Any], **types: type) -> None:
    """Check a tool call's arguments: exactly these names, of these types."""
    missing = [k for k in types if k not in arguments]
    extra = [k for k in arguments if k not in types]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing argument(s): {', '.join(missing)}")
        if extra:
            parts.append(f"unknown argument(s): {', '.join(extra)}")
        raise ToolError("; ".join(parts))
    for k, t in types.items():
        v = arguments[k]
        if t is int and isinstance(v, bool):
            raise ToolError(f"argument {k!r} must be an integer")
        if not isinstance(v, t):
            raise ToolError(
                f"argument {k!r} must be {'an integer' if t is int else 'a ' + t.__name__}"
            )
