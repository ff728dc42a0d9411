"""rollcall: fault-tolerant, multi-task asynchronous RL for LLM agents (docs/agents.md).

The user's API, one import::

    from rollcall import AgentContext, Outcome

    async def rollout(ctx: AgentContext, prompt: dict) -> Outcome: ...

The project's own packages are installed under this name (``rollcall.orchestrator``,
``rollcall.workers``, ``rollcall.tasks``, ``rollcall.migrations``; in the source tree they are
the top-level folders, linked from here), so a user's modules named ``tasks`` or ``workers``
neither shadow rollcall's nor are shadowed by them. The names below are loaded on first use:
``import rollcall.orchestrator.config`` does not pay for the agent runtime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollcall.tasks.base import (
        BaseTask,
        Observation,
        SplitTask,
        TaskPlugin,
        TaskSpec,
        Tool,
        ToolError,
        require_args,
    )
    from rollcall.workers.episode.api import (
        AgentUsageError,
        ContextLimit,
        Outcome,
        ReplayDivergence,
        Reply,
        ToolCall,
    )
    from rollcall.workers.episode.context import AgentContext

_EXPORTS = {
    # bring your own agent
    "AgentContext": "rollcall.workers.episode.runtime",
    "Outcome": "rollcall.workers.episode.api",
    "Reply": "rollcall.workers.episode.api",
    "ToolCall": "rollcall.workers.episode.api",
    "AgentUsageError": "rollcall.workers.episode.api",
    "ContextLimit": "rollcall.workers.episode.api",
    "ReplayDivergence": "rollcall.workers.episode.api",
    # a task plugin
    "TaskPlugin": "rollcall.tasks.base",
    "BaseTask": "rollcall.tasks.base",
    "SplitTask": "rollcall.tasks.base",
    "TaskSpec": "rollcall.tasks.base",
    "Tool": "rollcall.tasks.base",
    "Observation": "rollcall.tasks.base",
    "ToolError": "rollcall.tasks.base",
    "require_args": "rollcall.tasks.base",
}

__all__ = [
    "AgentContext",
    "AgentUsageError",
    "BaseTask",
    "ContextLimit",
    "Observation",
    "Outcome",
    "ReplayDivergence",
    "Reply",
    "SplitTask",
    "TaskPlugin",
    "TaskSpec",
    "Tool",
    "ToolCall",
    "ToolError",
    "require_args",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollcall' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
