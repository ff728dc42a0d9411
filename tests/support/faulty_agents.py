"""Agents whose code misbehaves on some inputs, for ``tests/integration/test_user_code.py``.

Each prompt row carries its index ``i``; an agent misbehaves on the prompts its ``every``
picks (``i % every == 0``, default 4: one prompt in four) and plays one trained turn and a
recorded reward step on the others. The faults are those of real agents: a tool awaiting an
inventory service that answers 500, a reward that comes out NaN, a wrong return type, an
``await`` that never ends, synchronous work that blocks the agent's thread.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rollcall import AgentContext, Outcome


def _bad(prompt: dict[str, Any]) -> bool:
    return int(prompt["i"]) % int(prompt.get("every", 4)) == 0


async def _turn(ctx: AgentContext, prompt: dict[str, Any]) -> float:
    reply = await ctx.chat([{"role": "user", "content": f"Count the crates in bay {prompt['i']}."}])
    return float(await ctx.step(_score, reply.text))


def _score(text: str) -> float:
    return float(len(text) % 3) / 2.0


async def check_stock(sku: str) -> int:
    await asyncio.sleep(0)  # the simulated HTTP call
    raise RuntimeError(f"inventory service returned 500 for {sku}")


async def raise_on_some(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    reward = await _turn(ctx, prompt)
    if _bad(prompt):
        await check_stock(f"SKU-{prompt['i']}")
    return Outcome(reward=reward)


async def raise_always(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    await _turn(ctx, prompt)
    await check_stock(f"SKU-{prompt['i']}")
    return Outcome(reward=1.0)


async def nan_on_some(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    reward = await _turn(ctx, prompt)
    return Outcome(reward=float("nan") if _bad(prompt) else reward)


async def wrong_type(ctx: AgentContext, prompt: dict[str, Any]) -> Any:
    reward = await _turn(ctx, prompt)
    return {"reward": reward}


async def hang_on_some(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    """Awaits forever on the bad prompts (outside any ``ctx`` call)."""
    reward = await _turn(ctx, prompt)
    if _bad(prompt):
        await asyncio.Event().wait()
    return Outcome(reward=reward)


async def block_on_some(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    """Blocks its thread with synchronous work for ``prompt["block_s"]`` seconds on the bad
    prompts, then answers: slow, not broken."""
    reward = await _turn(ctx, prompt)
    if _bad(prompt):
        time.sleep(float(prompt["block_s"]))
    return Outcome(reward=reward)


async def good(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    return Outcome(reward=await _turn(ctx, prompt))


# -- for the unit tests of one run (tests/unit/test_agent_failures.py) -------------------------


def _nan_judge(text: str) -> float:
    return float("nan")


async def step_nan(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    """A judge through ``ctx.step`` that comes out NaN."""
    reply = await ctx.chat([{"role": "user", "content": "Grade me."}])
    return Outcome(reward=await ctx.step(_nan_judge, reply.text))


async def info_nan(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    await ctx.chat([{"role": "user", "content": "Hello."}])
    return Outcome(reward=1.0, info={"ratio": float("nan")})


async def waits(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    """One model call, then an ``await`` that never ends."""
    await ctx.chat([{"role": "user", "content": "Hello."}])
    await asyncio.Event().wait()
    return Outcome(reward=1.0)


async def sleeps_then_calls(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    """Blocks its thread for ``prompt["block_s"]``, then asks the model; writes what became of
    its call to ``prompt["out"]``."""
    from pathlib import Path

    time.sleep(float(prompt["block_s"]))
    got = "answered"
    try:
        await ctx.chat([{"role": "user", "content": "Am I late?"}])
    except BaseException as e:  # cancelled (its timeout passed), or refused
        got = f"{type(e).__name__}: {e}"
        raise
    finally:
        Path(prompt["out"]).write_text(got)
    return Outcome(reward=1.0)


def _slow() -> int:
    time.sleep(5)
    return 1


async def own_timeout(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    """A ``ctx.step`` whose own timeout passes: the agent's TimeoutError, not the episode's."""
    await ctx.step(_slow, timeout_s=0.2)
    return Outcome(reward=1.0)


async def lets_cancel_escape(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    """Cancels a task of its own and awaits it: a ``CancelledError`` leaves the function."""
    task = asyncio.ensure_future(asyncio.sleep(10))
    await asyncio.sleep(0)
    task.cancel()
    await task
    return Outcome(reward=1.0)


async def bad_request(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    """Sends the endpoint a request it cannot serve (``n`` not a number); its reward is the
    HTTP status it got back."""
    import json
    import urllib.error
    import urllib.request

    body = {"model": "policy", "messages": [{"role": "user", "content": "Hi."}], "n": "two"}
    request = urllib.request.Request(
        f"{ctx.base_url}/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {ctx.api_key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    return Outcome(reward=float(status))
