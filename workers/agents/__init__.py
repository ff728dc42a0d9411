"""Bring your own agent: the API an agent function is written against (docs/agents.md).

An agent function is ``async def rollout(ctx: AgentContext, prompt: dict) -> Outcome``. Every
call it makes through ``ctx`` (``chat``, ``tool``, ``step``) is recorded in the episode's
checkpoint in PostgreSQL; after a crash the function is run again from the start and the
recorded results are returned in order, so generation continues at the first unrecorded call.
"""

from workers.agents.api import (
    AgentUsageError,
    ContextLimit,
    Outcome,
    ReplayDivergence,
    Reply,
    ToolCall,
)
from workers.agents.runtime import AgentContext

__all__ = [
    "AgentContext",
    "AgentUsageError",
    "ContextLimit",
    "Outcome",
    "ReplayDivergence",
    "Reply",
    "ToolCall",
]
