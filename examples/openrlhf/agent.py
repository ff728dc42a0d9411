"""Example (b): an OpenRLHF agent, ported in a few lines.

``AgentInstance`` below is written as an OpenRLHF ``--agent_func_path`` file writes it (the
shape of OpenRLHF's ``examples/python/agent_func.py``): ``reset(states)`` returns the first
``observation``; ``step(states)`` reads ``states["action_text"]`` (the model's last turn) and
``states["label"]`` and returns ``rewards``, ``scores``, ``environment_feedback``, ``done``
and ``extra_logs``. The differences: in OpenRLHF the class subclasses ``AgentInstanceBase``
and the file also defines an ``AgentExecutor`` (both left out: no OpenRLHF install needed);
OpenRLHF returns torch tensors for ``rewards`` and ``scores`` (plain floats here, so the result
can be recorded); and OpenRLHF appends the feedback text to the token stream, where
``rollout`` below sends it as the next message in the model's chat template.

The environment is arithmetic: a turn that calls ``calc`` (any JSON with an ``"expression"``
string) gets the result back; any other turn is the final answer, checked against the label.

``rollout`` is the adapter: the model's turns go through ``ctx.chat``, the environment's steps
through ``ctx.step`` (recorded, so a resumed rollout gets the same feedback without running the
environment again). The environment keeps no state of its own between steps: a recorded step
is not re-run on replay, so state kept on the instance would be missing after a resume.
Run it: ``rollcall run examples/openrlhf/config.yaml``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rollcall import AgentContext, Outcome
from rollcall.tasks.calculator import parse_number
from rollcall.tasks.safe_eval import CalcError, evaluate, format_number

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
MAX_STEPS = 6  # the task's max_turns (config.yaml)
_EXPRESSION = re.compile(r'"expression"\s*:\s*("(?:[^"\\]|\\.)*")')
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


# -- as it would look in OpenRLHF -----------------------------------------------------------


class AgentInstance:
    async def reset(self, states: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        return {"observation": f"{states['observation']}\n{INSTRUCTION}"}

    async def step(self, states: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        action, label = states["action_text"], states["label"]
        call = _EXPRESSION.search(action)
        if call is not None:  # a calc call: run it, the episode goes on
            try:
                feedback = format_number(evaluate(json.loads(call.group(1))))
            except (CalcError, ValueError) as e:
                feedback = f"error: {e}"
            return {
                "rewards": 0.0,
                "scores": 0.0,
                "environment_feedback": feedback,
                "done": False,
                "extra_logs": {"calc_calls": 1},
            }
        numbers = _NUMBER.findall(action)  # the final answer: its last number
        value = parse_number(numbers[-1]) if numbers else None
        right = value is not None and abs(value - float(label)) <= 1e-6 * max(1.0, abs(value))
        return {
            "rewards": 1.0 if right else 0.0,
            "scores": 1.0 if right else 0.0,
            "environment_feedback": "",
            "done": True,
            "extra_logs": {"answer": numbers[-1] if numbers else None},
        }


# -- the adapter: rollcall drives it --------------------------------------------------------


async def rollout(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    env = AgentInstance()
    # reset only reads its input: called directly, it gives the same observation on replay
    first = await env.reset({"observation": prompt["question"], "label": prompt["answer"]})
    msgs: list[dict[str, Any]] = [{"role": "user", "content": first["observation"]}]
    text = first["observation"]
    for _ in range(MAX_STEPS):
        reply = await ctx.chat(msgs, tools=[CALC])
        msgs.append(reply.message)
        states = {"observation_text": text, "action_text": reply.text, "label": prompt["answer"]}
        result = await ctx.step(env.step, states)
        if result["done"]:
            return Outcome(reward=float(result["rewards"]), info=result["extra_logs"])
        feedback = result["environment_feedback"]
        text += reply.text + feedback
        # not done: the turn called calc; its result goes back as the tool message
        call_id = reply.tool_calls[0].id if reply.tool_calls else None
        msgs.append({"role": "tool", "tool_call_id": call_id, "content": feedback})
    return Outcome(reward=0.0, info={"answer": None})
