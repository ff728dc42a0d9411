"""The soak's user agent (``ops/soak.py``): arithmetic word problems with two tools and an
LLM-judge reward, every call recorded (docs/agents.md), so that a fault anywhere in an episode
is resumed from PostgreSQL.

- one episode in three plays its turns through the node's OpenAI-compatible endpoint
  (``ctx.base_url``, the ``openai`` client), the others through ``ctx.chat``;
- ``calc`` runs isolated (``isolate=True``: the node's tool sandbox, a process per call) and
  takes ``CALC_S`` like a remote service would, so that the soak can SIGKILL a tool process
  mid-call; ``lookup`` is an async tool on the agent's event loop (a simulated HTTP call);
- the reward is an exact check (``ctx.step``) plus a judge's yes/no from the same policy in an
  untrained conversation (``ctx.chat(..., train=False)``), as in examples/judge.
"""

from __future__ import annotations

import asyncio
import json
import re
import zlib
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
LOOKUP: Any = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up in the glossary.",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string"}},
            "required": ["word"],
        },
    },
}
MAX_TURNS = 4
CALC_S = 0.4  # a calc call's latency: the window in which a tool process can be killed
JUDGE_WEIGHT = 0.2
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def calc(expression: str) -> str:
    import time

    time.sleep(CALC_S)
    try:
        return format_number(evaluate(expression))
    except CalcError as e:
        return f"error: {e}"


async def lookup(word: str) -> str:
    await asyncio.sleep(0.05)  # a simulated HTTP call
    return f"{word}: see the question"


def exact(text: str | None, answer: str) -> bool:
    numbers = _NUMBER.findall(text or "")
    value = parse_number(numbers[-1]) if numbers else None
    return value is not None and abs(value - float(answer)) <= 1e-6 * max(1.0, abs(value))


def calc_json(arguments: str) -> str:
    try:
        return calc(str(json.loads(arguments)["expression"]))
    except (ValueError, KeyError, TypeError) as e:
        return f"error: {e}"


async def _through_endpoint(ctx: AgentContext, messages: list[Any]) -> str | None:
    client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    try:
        for _ in range(MAX_TURNS):
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALC]
            )
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return message.content
            for call in message.tool_calls:
                arguments = getattr(getattr(call, "function", None), "arguments", "{}")
                result = await ctx.step(calc_json, arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    except openai.BadRequestError:  # the trajectory is full (rollout.max_tokens)
        return None
    finally:
        await client.close()
    return None


async def _through_chat(ctx: AgentContext, messages: list[Any]) -> str | None:
    for _ in range(MAX_TURNS):
        reply = await ctx.chat(messages, tools=[CALC, LOOKUP])
        messages.append(reply.message)
        if reply.answer is not None:
            return str(reply.answer)
        if reply.error is not None:
            messages.append({"role": "tool", "content": f"error: {reply.error}"})
            continue
        for call in reply.tool_calls:
            isolate = call.name == "calc"
            messages.append(await ctx.tool({"calc": calc, "lookup": lookup}, call, isolate=isolate))
    return None


async def rollout(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    messages: list[Any] = [{"role": "user", "content": f"{prompt['question']}\n{INSTRUCTION}"}]
    endpoint = zlib.crc32(str(prompt["question"]).encode()) % 3 == 0
    answer = await (_through_endpoint if endpoint else _through_chat)(ctx, messages)
    if answer is None:
        return Outcome(reward=0.0, info={"answer": None, "endpoint": endpoint})
    right = await ctx.step(exact, answer, prompt["answer"])
    question = (
        f"Question: {prompt['question']}\nReference answer: {prompt['answer']}\n"
        f"Proposed answer: {answer}\nIs the proposed answer correct? Reply yes or no."
    )
    judged = await ctx.chat([{"role": "user", "content": question}], train=False, max_tokens=8)
    says = "yes" in re.findall(r"[a-z]+", judged.text.lower())
    reward = (1.0 - JUDGE_WEIGHT) * right + JUDGE_WEIGHT * says
    return Outcome(reward=reward, info={"answer": answer, "exact": right, "judge": says,
                                        "endpoint": endpoint})  # fmt: skip
