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

from rollcall.workers.episode.api import (
    AgentUsageError,
    ContextLimit,
    Outcome,
    ReplayDivergence,
    Reply,
    ToolCall,
)
from rollcall.workers.episode.context import AgentContext

__all__ = [
    "AgentContext",
    "AgentUsageError",
    "ContextLimit",
    "Outcome",
    "ReplayDivergence",
    "Reply",
    "ToolCall",
]
