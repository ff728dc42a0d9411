"""Agents for ``tests/integration/test_dynamic_sampling.py``: one trained turn each, then a
reward that differs within a group only on some prompts. Each prompt row carries its index
``i`` and ``every``."""

from __future__ import annotations

from typing import Any

from rollcall import AgentContext, Outcome


async def some_vary(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    """On the prompts ``i % every == 0`` sample k is rewarded k % 2 (the group's rewards
    differ); on the others every sample gets 0."""
    await ctx.chat([{"role": "user", "content": f"Name a crate in bay {prompt['i']}."}])
    varied = int(prompt["i"]) % int(prompt.get("every", 3)) == 0
    return Outcome(reward=float(ctx.sample_index % 2) if varied else 0.0)


async def constant(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    """Every sample gets 0: a reward that never tells the samples apart."""
    await ctx.chat([{"role": "user", "content": f"Name a crate in bay {prompt['i']}."}])
    return Outcome(reward=0.0)
