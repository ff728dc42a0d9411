"""``echo``: repeat a short sequence of words. The smallest plugin: no tools, one turn. It
exercises the registry and drives the buffer's state machine in tests without a model."""

from __future__ import annotations

import random
from typing import Any, ClassVar

from pydantic import Field, model_validator

from rollcall.tasks.base import BaseTask, TaskSpec

DEFAULT_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")


class EchoSpec(TaskSpec):
    words: tuple[str, ...] = Field(default=DEFAULT_WORDS, min_length=1)
    min_length: int = Field(default=1, ge=1, le=64)
    max_length: int = Field(default=4, ge=1, le=64)

    @model_validator(mode="after")
    def _lengths(self) -> EchoSpec:
        if self.max_length < self.min_length:
            raise ValueError("max_length must be at least min_length")
        return self


class EchoTask(BaseTask):
    name: ClassVar[str] = "echo"
    description: ClassVar[str] = "Repeat a short sequence of words (no tools; for plumbing tests)."
    Spec: ClassVar[type[TaskSpec]] = EchoSpec

    def _target(self, spec: EchoSpec, stream: str, index: int) -> str:
        rng = random.Random(f"echo:{stream}:{spec.seed}:{index}")
        n = rng.randint(spec.min_length, spec.max_length)
        return " ".join(rng.choice(spec.words) for _ in range(n))

    def prompt(self, spec: TaskSpec, index: int) -> dict[str, Any]:
        assert isinstance(spec, EchoSpec)
        target = self._target(spec, "train", index)
        return {"index": index, "text": f"Repeat exactly: {target}", "target": target}

    def eval_prompt(self, spec: TaskSpec, index: int) -> dict[str, Any]:
        assert isinstance(spec, EchoSpec)
        # The vocabulary is tiny, so splits are by index stream, marked as held out.
        target = self._target(spec, "eval", index)
        return {
            "index": index,
            "text": f"Repeat exactly: {target}",
            "target": target,
            "held_out": True,
        }

    def instructions(self, spec: TaskSpec, prompt: dict[str, Any]) -> str:
        return str(prompt["text"])

    def reward(
        self,
        spec: TaskSpec,
        prompt: dict[str, Any],
        answer: str | None,
        state: dict[str, Any],
        turns: int,
    ) -> float:
        return 1.0 if answer is not None and answer.strip() == prompt["target"] else 0.0
