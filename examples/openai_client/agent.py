"""Example (c): an agent written with the ``openai`` client, trained as it is.

The client points at the rollout node's OpenAI-compatible endpoint (``ctx.base_url``) with the
episode's key (``ctx.api_key``): every ``chat.completions.create`` is served by the policy and
recorded exactly as a ``ctx.chat`` call is. The ``calc`` tool runs through ``ctx.step``, so a
resumed rollout gets the same results back. ``max_retries=0``: a failed call is the node's to
handle (it requeues the episode), not the client's to repeat.

Arithmetic word problems (``examples/arithmetic.jsonl``) in the shape the tiny model was
warm-started on. Run it: ``rollcall run examples/openai_client/config.yaml``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import openai

from rollcall import AgentContext, Outcome
from rollcall.tasks.calculator import parse_number
from rollcall.tasks.safe_eval import CalcError, evaluate, format_number

INSTRUCTION = "Use the calc tool for arithmetic. Give the final answer as a number."
CALC: Any = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and "
        "parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
MAX_TURNS = 6  # the task's max_turns (config.yaml)
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def calc(arguments: str) -> str:
    """The tool, given the call's JSON arguments; errors are observations for the model."""
    try:
        return format_number(evaluate(json.loads(arguments)["expression"]))
    except (CalcError, ValueError, KeyError, TypeError) as e:
        return f"error: {e}"


def correct(text: str | None, answer: str) -> bool:
    numbers = _NUMBER.findall(text or "")  # the reply's last number is its answer
    value = parse_number(numbers[-1]) if numbers else None
    return value is not None and abs(value - float(answer)) <= 1e-6 * max(1.0, abs(value))


async def rollout(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    messages: list[Any] = [{"role": "user", "content": f"{prompt['question']}\n{INSTRUCTION}"}]
    final = None
    try:
        for _ in range(MAX_TURNS):
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALC]
            )
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                final = message.content
                break
            for call in message.tool_calls:
                result = await ctx.step(calc, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    except openai.BadRequestError as e:  # the trajectory is full (rollout.max_tokens)
        return Outcome(reward=0.0, info={"stopped": e.message})
    finally:
        await client.close()
    return Outcome(reward=1.0 if correct(final, prompt["answer"]) else 0.0, info={"answer": final})
