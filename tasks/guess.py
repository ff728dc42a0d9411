"""``guess``: find a secret number with a ``guess`` tool that answers higher / lower.

A multi-turn feedback game: the environment, not the final answer, decides success. Reward:
1 for a game solved in one guess, falling linearly to 0.5 for one solved with the last allowed
guess; 0 when the guesses run out or the game is not solved.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from pydantic import Field, model_validator

from rollcall.tasks.base import Observation, SplitTask, TaskSpec, Tool, ToolError, require_args


class GuessSpec(TaskSpec):
    low: int = Field(default=1)
    high: int = Field(default=100)
    max_guesses: int = Field(default=8, ge=1, le=64)
    max_turns: int = Field(default=10, ge=1, le=128)

    @model_validator(mode="after")
    def _range(self) -> GuessSpec:
        if self.high <= self.low:
            raise ValueError("high must be greater than low")
        return self


class GuessTask(SplitTask):
    name: ClassVar[str] = "guess"
    description: ClassVar[str] = (
        "Find a secret number with higher/lower feedback (multi-turn game)."
    )
    Spec: ClassVar[type[TaskSpec]] = GuessSpec
    # the tool reads it (call_tool); nothing else of the prompt row reaches the tool
    tool_prompt_fields: ClassVar[tuple[str, ...]] = ("secret",)

    def draw(self, spec: TaskSpec, rng: random.Random) -> tuple[str, dict[str, Any]]:
        assert isinstance(spec, GuessSpec)
        secret = rng.randint(spec.low, spec.high)
        # Few distinct secrets exist, so the split is by game: a held-out game may share its
        # secret with a training game but never its identity.
        game = rng.getrandbits(64)
        return f"{secret}:{game}", {"secret": secret, "game": game}

    def instructions(self, spec: TaskSpec, prompt: dict[str, Any]) -> str:
        assert isinstance(spec, GuessSpec)
        return (
            f"I am thinking of a whole number from {spec.low} to {spec.high}. Find it with the "
            f"guess tool; after each guess I say higher, lower or correct. You have "
            f"{spec.max_guesses} guesses."
        )

    def tools(self, spec: TaskSpec) -> list[Tool]:
        return [
            Tool(
                name="guess",
                description="Guess the secret number; the answer is higher, lower or correct.",
                parameters={
                    "type": "object",
                    "properties": {"number": {"type": "integer"}},
                    "required": ["number"],
                },
            )
        ]

    def initial_state(self, spec: TaskSpec, prompt: dict[str, Any]) -> dict[str, Any]:
        return {"guesses": 0, "solved": False}

    def call_tool(
        self,
        spec: TaskSpec,
        prompt: dict[str, Any],
        state: dict[str, Any],
        name: str,
        arguments: dict[str, Any],
    ) -> Observation:
        assert isinstance(spec, GuessSpec)
        if name != "guess":
            return super().call_tool(spec, prompt, state, name, arguments)
        require_args(arguments, number=int)
        if state.get("solved"):
            raise ToolError("the game is already won")
        guesses = int(state.get("guesses", 0))
        if guesses >= spec.max_guesses:
            raise ToolError("no guesses left")
        n = arguments["number"]
        if not spec.low <= n <= spec.high:
            raise ToolError(f"the number is between {spec.low} and {spec.high}")
        guesses += 1
        secret = int(prompt["secret"])
        if n == secret:
            return Observation("correct", {"guesses": guesses, "solved": True}, done=True)
        left = spec.max_guesses - guesses
        word = "higher" if secret > n else "lower"
        return Observation(
            f"{word} ({left} guesses left)",
            {"guesses": guesses, "solved": False},
            done=left == 0,
        )

    def reward(
        self,
        spec: TaskSpec,
        prompt: dict[str, Any],
        answer: str | None,
        state: dict[str, Any],
        turns: int,
    ) -> float:
        assert isinstance(spec, GuessSpec)
        if not state.get("solved"):
            return 0.0
        used = int(state["guesses"])
        if spec.max_guesses == 1:
            return 1.0
        return 1.0 - 0.5 * (used - 1) / (spec.max_guesses - 1)
