"""Example (d): a reward from an LLM judge served by the rollout engine itself.

The agent solves an arithmetic word problem with the ``calc`` tool (``ctx.chat`` and
``ctx.tool``), then asks the same model, in a separate untrained conversation
(``ctx.chat(..., train=False)``), whether its answer matches the reference. The judge's
generation is recorded like any call (a resumed rollout gets the same verdict), but it is not
part of the trained trajectory.

Be honest about the judge: the tiny model was only warm-started on the calculator prompts and
has never seen a yes/no question, so its verdicts are close to noise; and the judge is the
policy, so it changes as training goes. The reward is therefore mostly an exact check of the
number, recorded through ``ctx.step``; the judge adds ``JUDGE_WEIGHT`` when it says yes. The
sample's info stores both, and whether they agree, to measure the judge before trusting it
more (raise ``JUDGE_WEIGHT`` on a model that judges well).
Run it: ``rollcall run examples/judge/config.yaml``.
"""

from __future__ import annotations

import re
from typing import Any

from rollcall import AgentContext, Outcome
from rollcall.tasks.calculator import parse_number
from rollcall.tasks.safe_eval import evaluate, format_number

INSTRUCTION = "Use the calc tool for arithmetic. Give the final answer as a number."
CALC = {
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
JUDGE_WEIGHT = 0.2
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def calc(expression: str) -> str:
    return format_number(evaluate(expression))  # an error becomes an "error: ..." observation


def exact(text: str, answer: str) -> bool:
    numbers = _NUMBER.findall(text)  # the reply's last number is its answer
    value = parse_number(numbers[-1]) if numbers else None
    return value is not None and abs(value - float(answer)) <= 1e-6 * max(1.0, abs(value))


def verdict(text: str) -> bool | None:
    words = re.findall(r"[a-z]+", text.lower())
    return True if "yes" in words else False if "no" in words else None


async def rollout(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": f"{prompt['question']}\n{INSTRUCTION}"}
    ]
    answer = None
    for _ in range(MAX_TURNS):
        reply = await ctx.chat(msgs, tools=[CALC])
        msgs.append(reply.message)
        if reply.answer is not None:
            answer = reply.answer
            break
        if reply.error is not None:  # a turn the tool-call format could not read
            msgs.append({"role": "tool", "content": f"error: {reply.error}"})
            continue
        for call in reply.tool_calls:
            msgs.append(await ctx.tool({"calc": calc}, call))
    if answer is None:
        return Outcome(reward=0.0, info={"answer": None})
    right = await ctx.step(exact, answer, prompt["answer"])
    question = (
        f"Question: {prompt['question']}\nReference answer: {prompt['answer']}\n"
        f"Proposed answer: {answer}\nIs the proposed answer correct? Reply yes or no."
    )
    judged = await ctx.chat([{"role": "user", "content": question}], train=False, max_tokens=8)
    says = verdict(judged.text)
    reward = (1.0 - JUDGE_WEIGHT) * right + JUDGE_WEIGHT * (says is True)
    agree = None if says is None else says == right
    info = {"answer": answer, "exact": right, "judge": says, "agree": agree}
    return Outcome(reward=reward, info=info)
