"""The one place that decides how an episode is played: an agent task (``tasks[].agent``) by
the user's agent function with its record and replay journal (``AgentRun``), a built-in plugin
by the plugin loop (``AgentLoop``). The rollout node, the evaluator and ``rollcall rollout
preview`` all start their episodes here, and both players answer ``run(resume=, on_turn=)``
with a ``Played``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollcall.tasks.agent import AgentSpec
from rollcall.tasks.base import TaskPlugin, TaskSpec
from rollcall.workers.episode.chat import Chat
from rollcall.workers.episode.engine import Engine
from rollcall.workers.episode.loop import AgentLoop, Limits
from rollcall.workers.episode.runtime import AgentRun
from rollcall.workers.episode.tools import ToolRunner


def player(
    engine: Engine,
    chat: Chat,
    plugin: TaskPlugin,
    spec: TaskSpec,
    prompt: dict[str, Any],
    tools: ToolRunner,
    limits: Limits,
    *,
    endpoint_host: str = "127.0.0.1",
    on_divergence: Callable[[str, int], None] | None = None,
    episode_id: int | None = None,
    sample_index: int = 0,
) -> AgentLoop | AgentRun:
    """The player of one sample: ``AgentRun`` for an agent task, else ``AgentLoop``."""
    if isinstance(spec, AgentSpec):
        return AgentRun(
            engine, chat, spec, prompt, tools, limits,
            endpoint_host=endpoint_host, on_divergence=on_divergence,
            episode_id=episode_id, sample_index=sample_index,
        )  # fmt: skip
    return AgentLoop(engine, chat.tokenizer, plugin, spec, prompt, tools, limits, chat)
