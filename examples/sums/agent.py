"""A one-turn agent for a small pretrained model: add two numbers and reply with the number only.

The reward teaches the format and the sum together: 1.0 for a reply that is exactly the sum
(a final period tolerated), 0.5 for a reply whose last number is the sum but that says more
("14 + 8 = 22"), 0 otherwise. SmolLM2-135M-Instruct starts near 0.1 on it at temperature 0.7
(configs/smollm2-lora.yaml, docs/models.md). The prompts are ``sums.jsonl`` beside this file
(``python examples/make_prompts.py`` writes them).
"""

from __future__ import annotations

import re
from typing import Any

from rollcall import AgentContext, Outcome

_NUMBER = re.compile(r"-?\d+")


def score(reply: str | None, answer: str) -> float:
    if reply is None:
        return 0.0
    text = reply.strip()
    if text.rstrip(".").strip() == answer:
        return 1.0
    numbers = _NUMBER.findall(text)
    return 0.5 if numbers and numbers[-1] == answer else 0.0


async def rollout(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    msgs = [{"role": "user", "content": f"{prompt['question']} Reply with only the number."}]
    reply = await ctx.chat(msgs)
    text = reply.answer if reply.answer is not None else reply.message.get("content")
    return Outcome(reward=score(text, str(prompt["answer"])), info={"reply": text})
