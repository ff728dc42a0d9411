"""``calculator``: multi-step arithmetic word problems, with a ``calc`` tool.

The agent may call ``calc`` (a safe evaluator, ``rollcall.tasks.safe_eval``) as often as it likes,
then gives its final answer. Reward: 1 for the correct number; 0.1 for a well-formed number that is
wrong (a small format term that helps a weak policy learn the answer syntax); 0 otherwise.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import Field

from rollcall.tasks.base import Observation, SplitTask, TaskSpec, Tool, ToolError, require_args
from rollcall.tasks.safe_eval import CalcError, evaluate, format_number

FORMAT_REWARD = 0.1
NAMES = ("Ada", "Bo", "Cyra", "Dev", "Emil", "Faye", "Goro", "Hana")

# Each template: (statement with {placeholders}, the expression that solves it, number sampler).
# Operands stay small (mostly one or two digits, at most three): the problems are still
# multi-step, but the tiny local model can learn to copy their numbers into a calc expression.
Sampler = Callable[[random.Random], dict[str, int]]


def _stock(r: random.Random) -> dict[str, int]:
    a, b = r.randint(12, 60), r.randint(3, 12)
    return {"a": a, "b": b, "c": r.randint(5, min(99, a * b - 1))}


def _pencils(r: random.Random) -> dict[str, int]:
    a, b = r.randint(3, 20), r.randint(4, 12)
    d = r.randint(2, 9)
    return {"a": a, "b": b, "d": d, "c": r.randint(1, max(1, min(30, (a * b) // d)))}


def _train(r: random.Random) -> dict[str, int]:
    return {
        "a": r.randint(20, 90),
        "b": r.randint(2, 9),
        "c": r.randint(20, 90),
        "d": r.randint(2, 9),
    }


def _tank(r: random.Random) -> dict[str, int]:
    b = r.randint(2, 12)
    return {"b": b, "a": b * r.randint(5, 40), "c": r.randint(2, 30)}


def _savings(r: random.Random) -> dict[str, int]:
    a, b = r.randint(5, 40), r.randint(3, 12)
    return {"a": a, "b": b, "c": r.randint(5, min(99, a * b // 2)), "d": r.randint(2, 6)}


TEMPLATES: tuple[tuple[str, str, Sampler], ...] = (
    (
        "A warehouse holds {a} boxes with {b} items in each box. Then {c} items are shipped out. "
        "How many items are left in the warehouse?",
        "{a} * {b} - {c}",
        _stock,
    ),
    (
        "{name} buys {a} packs of {b} pencils and gives {c} pencils to each of {d} friends. How "
        "many pencils does {name} have left?",
        "{a} * {b} - {c} * {d}",
        _pencils,
    ),
    (
        "A train runs at {a} km per hour for {b} hours, then at {c} km per hour for {d} hours. "
        "How many kilometres does it travel in total?",
        "{a} * {b} + {c} * {d}",
        _train,
    ),
    (
        "A tank of {a} litres is poured equally into {b} bottles, and then {c} litres are added "
        "to each bottle. How many litres does one bottle hold now?",
        "{a} // {b} + {c}",
        _tank,
    ),
    (
        "{name} saves {a} coins every week for {b} weeks, spends {c} coins, and splits the rest "
        "equally among {d} jars, keeping any remainder out. How many coins go into each jar?",
        "({a} * {b} - {c}) // {d}",
        _savings,
    ),
)

_NUMBER = re.compile(r"^[-+]?\d[\d,]*(\.\d+)?$|^[-+]?\.\d+$")
_ANY_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


class CalculatorSpec(TaskSpec):
    max_turns: int = Field(default=6, ge=1, le=64)


class CalculatorTask(SplitTask):
    name: ClassVar[str] = "calculator"
    description: ClassVar[str] = "Multi-step arithmetic word problems with a calc tool."
    Spec: ClassVar[type[TaskSpec]] = CalculatorSpec

    def draw(self, spec: TaskSpec, rng: random.Random) -> tuple[str, dict[str, Any]]:
        t = rng.randrange(len(TEMPLATES))
        template, expression, sampler = TEMPLATES[t]
        values = sampler(rng)
        key = f"{t}:" + ",".join(f"{k}={values[k]}" for k in sorted(values))
        expr = expression.format(**values)
        question = template.format(name=rng.choice(NAMES), **values)
        return key, {
            "question": question,
            "expression": expr,
            "answer": format_number(evaluate(expr)),
            "key": key,
        }

    def instructions(self, spec: TaskSpec, prompt: dict[str, Any]) -> str:
        return (
            f"{prompt['question']}\n"
            "Use the calc tool for arithmetic. Give the final answer as a number."
        )

    def tools(self, spec: TaskSpec) -> list[Tool]:
        return [
            Tool(
                name="calc",
                description=(
                    "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses."
                ),
                parameters={
                    "type": "object",
                    "properties": {"expression": {"type": "string"}},
                    "required": ["expression"],
                },
            )
        ]

    def call_tool(
        self,
        spec: TaskSpec,
        prompt: dict[str, Any],
        state: dict[str, Any],
        name: str,
        arguments: dict[str, Any],
    ) -> Observation:
        if name != "calc":
            return super().call_tool(spec, prompt, state, name, arguments)
        require_args(arguments, expression=str)
        try:
            value = evaluate(arguments["expression"])
        except CalcError as e:
            raise ToolError(str(e)) from None
        calls = int(state.get("calc_calls", 0)) + 1
        return Observation(format_number(value), {**state, "calc_calls": calls})

    def read_answer(self, spec: TaskSpec, text: str) -> str | None:
        """One number is read as written (``42``, ``42 km.``: the reward tolerates units); in a
        reply with several, the last is the answer (``19 - 5 = 9. The answer is 9.``); a reply
        without a number is kept as it is (and earns nothing)."""
        numbers = _ANY_NUMBER.findall(text)
        if len(numbers) == 1 and parse_number(text) is not None:
            return text.strip()
        return numbers[-1] if numbers else text.strip()

    def reward(
        self,
        spec: TaskSpec,
        prompt: dict[str, Any],
        answer: str | None,
        state: dict[str, Any],
        turns: int,
    ) -> float:
        value = parse_number(answer)
        if value is None:
            return 0.0
        if abs(value - float(prompt["answer"])) <= 1e-6 * max(1.0, abs(value)):
            return 1.0
        return FORMAT_REWARD


def parse_number(answer: str | None) -> float | None:
    """A final answer as a number: ``1,234``, ``-5``, ``3.5``; trailing units and a final
    period are tolerated (``42 km.``); anything else is not a number."""
    if answer is None:
        return None
    text = answer.strip().rstrip(".").strip()
    if not text:
        return None
    first = text.split()[0]
    if not _NUMBER.match(first):
        return None
    try:
        return float(first.replace(",", ""))
    except ValueError:
        return None
