"""The one place an episode is started: every task's sample is played by the episode runtime
(``AgentRun``), an agent task by the user's agent function (``spec.agent``), a built-in plugin
by its adapter (``plugin_agent``). The rollout node, the evaluator and ``rollcall rollout
preview`` all start their episodes here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollcall.tasks.agent import AgentSpec
from rollcall.tasks.base import Task, TaskPlugin, TaskSpec
from rollcall.workers.episode.chat import Chat
from rollcall.workers.episode.engine import Engine
from rollcall.workers.episode.plugin import plugin_agent
from rollcall.workers.episode.runtime import AgentRun
from rollcall.workers.episode.tools import ToolRunner
from rollcall.workers.episode.trajectory import Limits


def player(
    engine: Engine,
    chat: Chat,
    plugin: Task,
    spec: TaskSpec,
    prompt: dict[str, Any],
    tools: ToolRunner,
    limits: Limits,
    *,
    endpoint_host: str = "127.0.0.1",
    on_divergence: Callable[[str, int], None] | None = None,
    episode_id: int | None = None,
    sample_index: int = 0,
) -> AgentRun:
    """The player of one sample of ``plugin``'s task under ``spec``."""
    fn = None
    if not isinstance(spec, AgentSpec):
        if not isinstance(plugin, TaskPlugin):
            raise TypeError(f"task {plugin.name!r} has neither an agent function nor tools")
        fn = plugin_agent(plugin, spec)
    return AgentRun(
        engine, chat, spec, prompt, tools, limits, fn=fn,
        endpoint_host=endpoint_host, on_divergence=on_divergence,
        episode_id=episode_id, sample_index=sample_index,
    )  # fmt: skip
