"""One episode: the runtime that plays an agent function with its record and replay, the
built-in plugins' adapter (an agent function too), the chat format, tool calls and the tool
sandbox (``play.player`` starts every sample). Its package
exports the API an agent function is written against (users import it as ``rollcall``,
docs/agents.md).

An agent function is ``async def rollout(ctx: AgentContext, prompt: dict) -> Outcome``. Every
call it makes through ``ctx`` (``chat``, ``tool``, ``step``) is recorded in the episode's
checkpoint in PostgreSQL; after a crash the function is run again from the start and the
recorded results are returned in order, so generation continues at the first unrecorded call.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollcall.workers.episode.api import (
        AgentUsageError,
        ContextLimit,
        Outcome,
        ReplayDivergence,
        Reply,
        ToolCall,
    )
    from rollcall.workers.episode.context import AgentContext

# Loaded on first use, so that a process that needs one module of this package (the tool
# server and its zygote: ``tools`` and ``sandbox``) does not import the whole agent runtime:
# every tool call forks such a process, and a smaller one forks faster
_EXPORTS = {
    "AgentContext": "rollcall.workers.episode.context",
    "AgentUsageError": "rollcall.workers.episode.api",
    "ContextLimit": "rollcall.workers.episode.api",
    "Outcome": "rollcall.workers.episode.api",
    "ReplayDivergence": "rollcall.workers.episode.api",
    "Reply": "rollcall.workers.episode.api",
    "ToolCall": "rollcall.workers.episode.api",
}

__all__ = [
    "AgentContext",
    "AgentUsageError",
    "ContextLimit",
    "Outcome",
    "ReplayDivergence",
    "Reply",
    "ToolCall",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
