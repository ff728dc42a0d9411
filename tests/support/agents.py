"""Agent functions and an engine hook for the agent tests (``tests/integration/test_agents.py``).

``steady`` is a deterministic agent of four trained turns (its second and fourth through the
node's OpenAI-compatible endpoint with the ``openai`` client, the others through ``ctx.chat``),
each followed by a recorded ``ctx.step``. ``flaky`` puts its process id in its first message,
so a replay in another process asks for a different call than the recorded one. Before its
third call, ``steady`` waits until ``flaky`` has recorded two calls (both are samples of one
episode on one node) and raises the flag ``third``; the fake at the engine seam, ``kill_third``,
then SIGKILLs the rollout node in that generate call (once: the flag ``killed``). It logs every
generate request's context (a digest) to ``generates`` in the flag folder, so a test can count
the engine's calls across the node's incarnations. The flag folder is the prompt's ``flags``.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path
from typing import Any

from rollcall import AgentContext, Outcome
from rollcall.workers.episode.engine import Engine, Generation, GenerationRequest


def digest(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def _length(text: str) -> int:
    return len(text)


async def steady(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    import openai

    flags = Path(prompt["flags"])
    client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": prompt["question"]}]
    total = 0
    for turn in range(4):
        if turn == 2 and (flags / "arm").exists() and not (flags / "killed").exists():
            deadline = time.monotonic() + 60
            while not (flags / "flaky2").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            (flags / "third").touch()
        if turn not in prompt.get("endpoint_turns", (1, 3)):
            reply = await ctx.chat(msgs)
            message = reply.message
            text = reply.text
        else:
            out = await client.chat.completions.create(model="policy", messages=msgs)  # type: ignore[arg-type]
            message = out.choices[0].message.model_dump(exclude_none=True)
            text = out.choices[0].message.content or ""
        msgs.append(message)
        total += await ctx.step(_length, text)
        msgs.append({"role": "user", "content": f"Go on ({turn})."})
    await client.close()
    return Outcome(reward=float(total % 3) / 2.0, info={"chars": total})


async def flaky(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    flags = Path(prompt["flags"])
    msgs = [{"role": "user", "content": f"{prompt['question']} (process {os.getpid()})"}]
    for turn in range(3):
        reply = await ctx.chat(msgs)
        msgs += [reply.message, {"role": "user", "content": "Again."}]
        if turn == 1 and (flags / "arm").exists() and not (flags / "killed").exists():
            (flags / "flaky2").touch()  # then wait for the kill, with two calls recorded
            deadline = time.monotonic() + 60
            while not (flags / "killed").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
    return Outcome(reward=float(len(msgs) % 2))


async def either(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    """``steady`` for sample 0 of an episode, ``flaky`` for the others (by the prompt's own
    ``role`` when given)."""
    if ctx.sample_index == 0:
        return await steady(ctx, prompt)
    return await flaky(ctx, prompt)


class _KillThird:
    def __init__(self, inner: Engine, flags: str, engine_core: bool = False) -> None:
        self.inner = inner
        self.engine_core = engine_core
        self.tokenizer = inner.tokenizer
        self.flags = Path(flags)

    @property
    def version(self) -> int:
        return self.inner.version

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        with (self.flags / "generates").open("a") as f:
            for r in requests:
                f.write(f"{os.getpid()} {digest(r.prompt_ids)}\n")
        if (self.flags / "third").exists() and not (self.flags / "killed").exists():
            (self.flags / "killed").touch()
            if self.engine_core:  # vLLM's EngineCore (and its worker) die; the actor lives
                pids = self.inner.engine_pids()  # type: ignore[attr-defined]
                (self.flags / "engine_pids").write_text(" ".join(map(str, pids)))
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 60  # until vLLM itself knows: this call fails
                while self.inner.failure() is None and time.monotonic() < deadline:  # type: ignore[attr-defined]
                    time.sleep(0.05)
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return self.inner.generate(requests)

    def load_weights(self, version: int, location: str) -> None:
        self.inner.load_weights(version, location)

    def health(self) -> Any:
        return self.inner.health()

    def __getattr__(self, name: str) -> Any:  # the engine's other parts (vLLM's probe, close)
        return getattr(self.inner, name)


def kill_third(engine: Engine, flags: str) -> Any:
    return _KillThird(engine, flags)


def kill_engine_third(engine: Engine, flags: str) -> Any:
    """As ``kill_third``, but SIGKILLs vLLM's EngineCore processes instead of the node."""
    return _KillThird(engine, flags, engine_core=True)


# -- agents for the unit tests of tools (tests/unit/test_agent_inputs.py) ----------------------


def raising(expression: str) -> str:
    raise ValueError(f"cannot evaluate {expression!r}")


def hanging(expression: str) -> str:
    while True:  # a tool that never returns (and burns its thread)
        time.sleep(0.05)


def answer(expression: str) -> str:
    return "42"


def huge(expression: str) -> str:
    """An observation of 200 KiB."""
    return "x" * (200 * 1024)


async def big_step(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    """A ``ctx.step`` whose result is ``prompt["size"]`` bytes of text."""
    await ctx.chat([{"role": "user", "content": "Hello."}])
    text = await ctx.step(_text_of, int(prompt["size"]))
    return Outcome(reward=0.0, info={"length": len(text)})


def _text_of(size: int) -> str:
    return "y" * size


async def posting(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    """Posts a body of ``prompt["size"]`` bytes to its endpoint, with its key and without:
    the statuses and the error messages are the outcome's info."""
    import asyncio
    import json
    import urllib.error
    import urllib.request

    def post(key: str | None) -> tuple[int, str]:
        body = json.dumps({"messages": [{"role": "user", "content": "x" * prompt["size"]}]})
        req = urllib.request.Request(f"{ctx.base_url}/chat/completions", data=body.encode())
        req.add_header("Content-Type", "application/json")
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, ""
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())["error"]["message"]

    with_key = await asyncio.to_thread(post, ctx.api_key)
    without = await asyncio.to_thread(post, None)
    await ctx.chat([{"role": "user", "content": "Hello."}])
    return Outcome(reward=0.0, info={"with_key": with_key, "without_key": without})


async def expecting(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    """Asks its endpoint for ``100 Continue`` before a body of ``prompt["size"]`` bytes: the
    first line of the answer, and how many body bytes it sent before it came."""
    import asyncio
    import socket
    from urllib.parse import urlsplit

    def ask() -> tuple[str, int]:
        where = urlsplit(ctx.base_url)
        with socket.create_connection((where.hostname, where.port), timeout=30) as s:
            s.sendall(
                (
                    f"POST {where.path}/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    f"Authorization: Bearer {ctx.api_key}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {prompt['size']}\r\nExpect: 100-continue\r\n\r\n"
                ).encode()
            )
            return s.makefile("rb").readline().decode().strip(), 0

    answer, sent = await asyncio.to_thread(ask)
    await ctx.chat([{"role": "user", "content": "Hello."}])
    return Outcome(reward=0.0, info={"answer": answer, "sent": sent})


async def tool_user(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    """One trained turn, then the tool the prompt names (by ``prompt["tool"]``, with
    ``prompt["options"]`` for ``ctx.tool``) applied to a call the agent writes itself; the
    observation is returned as the outcome's info."""
    from rollcall import ToolCall

    reply = await ctx.chat([{"role": "user", "content": "Compute 6 * 7."}])
    call = ToolCall("call_x", "calc", prompt.get("arguments", {"expression": "6 * 7"}))
    tools = {"raising": raising, "hanging": hanging, "answer": answer, "huge": huge}
    message = await ctx.tool(tools[prompt["tool"]], call, **prompt.get("options", {}))
    return Outcome(reward=float(reply.num_tokens > 0), info={"observation": message["content"]})


def not_async(ctx: Any, prompt: Any) -> None:
    return None


async def one_argument(ctx: Any) -> None:
    return None


async def rewriter(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
    """Rewrites its trained conversation instead of extending it (refused)."""
    await ctx.chat([{"role": "user", "content": "First."}])
    await ctx.chat(
        [{"role": "user", "content": "Something else."}, {"role": "user", "content": "x"}]
    )
    return Outcome(reward=0.0)
