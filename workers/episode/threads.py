"""Threads an agent's calls run on: a call that blocks (a sync tool, a checkpoint) runs on a
daemon thread of its own, so a hung one never keeps the agent's event loop from ending; a tool
call with its timeout, on such a thread or in the node's tool process."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollcall.tasks.agent import AGENT_FILE_MODULE
from rollcall.workers.episode.api import ToolCall

if TYPE_CHECKING:
    from rollcall.workers.episode.tools import ToolRunner


def in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
    """``fn`` on a daemon thread of its own, awaitable. Not the loop's default executor: a call
    that never returns (a hung tool) must not keep ``asyncio.run`` from ending."""
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def target() -> None:
        if not done.set_running_or_notify_cancel():
            return
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as e:
            done.set_exception(e)

    threading.Thread(target=target, daemon=True, name="agent-call").start()
    return asyncio.wrap_future(done)


async def bounded(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float) -> Any:
    """``fn(*args, **kwargs)`` within ``timeout`` seconds: awaited if async, else on a thread
    (a sync function that never returns leaves its thread behind: ``isolate=True`` kills it)."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an async callable object
    ):
        return await asyncio.wait_for(fn(*args, **kwargs), timeout)
    value = await asyncio.wait_for(in_thread(fn, *args, **kwargs), timeout)
    if inspect.isawaitable(value):
        value = await asyncio.wait_for(value, timeout)
    return value


def by_value(fn: Any) -> None:
    """A function from an agent file (``rollcall.tasks.agent`` imports it under a name no other
    process knows) is sent to the tool process by value, not by a reference it could not
    import."""
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    if module is not None and module.__name__.startswith(AGENT_FILE_MODULE):
        from ray import cloudpickle

        cloudpickle.register_pickle_by_value(module)


async def run_tool(
    target: Any,
    call: ToolCall,
    fn: Any,
    timeout_s: float,
    *,
    runner: ToolRunner | None,
    network: bool,
) -> tuple[bool, Any]:
    """(True, the result) or (False, why it failed) of ``target`` (the tool ``call`` names:
    None when ``fn``, a dict of tools, has none by that name) called with the call's arguments
    within ``timeout_s``: on a thread, or in ``runner``'s tool process (killed when it hangs)."""
    if target is None:
        known = ", ".join(sorted(fn)) if isinstance(fn, dict) else "none"
        return False, f"unknown tool {call.name!r}; available tools: {known}"
    if not isinstance(call.arguments, dict):
        return False, "tool arguments must be a JSON object"
    timeout = float(timeout_s)
    if runner is not None:
        by_value(target)
        result: tuple[bool, Any] = await in_thread(
            runner.call_function, target, (), dict(call.arguments), timeout, call.name,
            network=network,
        )  # fmt: skip
        return result
    try:
        return True, await bounded(target, (), dict(call.arguments), timeout)
    except TimeoutError:
        return False, f"the tool {call.name!r} did not answer within {timeout:g} s"
    except Exception as e:
        return False, f"{type(e).__name__}: {e}"
