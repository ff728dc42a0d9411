"""A one-turn agent for a small pretrained model: add two numbers; the answer is the reply's last
number.

The reward grades the answer as math graders do, by the final number of the reply: 1.0 when it
is the sum ("22", "14 + 8 = 22", "The answer is 22."), 0 otherwise ("22 is 14 + 8"). An
earlier version paid 1.0 for the number alone and 0.5 for a longer reply ending with it: it
set the format against accuracy (SmolLM2 adds worse without writing the sum out) and its curve
dipped (docs/models.md). SmolLM2-135M-Instruct starts near 0.3 on it at temperature 0.7
(configs/smollm2-lora.yaml). The prompts are ``sums.jsonl`` beside this file
(``python examples/make_prompts.py`` writes them).
"""

from __future__ import annotations

import re
from typing import Any

from rollcall import AgentContext, Outcome

_NUMBER = re.compile(r"-?\d+")


def score(reply: str | None, answer: str) -> float:
    numbers = _NUMBER.findall(reply or "")
    return 1.0 if numbers and numbers[-1] == answer else 0.0


async def rollout(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    msgs = [{"role": "user", "content": f"{prompt['question']} Reply with only the number."}]
    reply = await ctx.chat(msgs)
    text = reply.answer if reply.answer is not None else reply.message.get("content")
    return Outcome(reward=score(text, str(prompt["answer"])), info={"reply": text})
