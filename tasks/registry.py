"""Registry of task plugins by name.

Built-in plugins are listed here by name and module (imported only when asked for);
third-party plugins register under the ``rollcall.tasks`` entry-point group
(``name = "package.module:PluginClass"``). There is no way to load a plugin from a file path.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points

from rollcall.tasks.base import Task, TaskPlugin

ENTRY_POINT_GROUP = "rollcall.tasks"

# name -> "module:Class" of the built-in plugins
BUILTIN: dict[str, str] = {
    "calculator": "rollcall.tasks.calculator:CalculatorTask",
    "echo": "rollcall.tasks.echo:EchoTask",
    "guess": "rollcall.tasks.guess:GuessTask",
    "retrieval": "rollcall.tasks.retrieval:RetrievalTask",
}
# Built-in timing models for benchmarks (ops/bench/): plugins like the others, but not tasks to
# learn (no language), so the tiny model's tokenizer and warm start leave them out.
BENCHMARK: dict[str, str] = {
    "longtail": "rollcall.tasks.longtail:LongtailTask",
}
# The plugin of agent tasks (the user's own agent function over a prompt file, docs/agents.md):
# it has no default spec (the function and the prompts are the user's), so it is no task to
# warm-start or sample on its own either.
AGENT: dict[str, str] = {
    "agent": "rollcall.tasks.agent:AgentTask",
}


class UnknownPluginError(LookupError):
    def __init__(self, name: str, available: list[str]) -> None:
        self.name = name
        self.available = available
        super().__init__(
            f"unknown task plugin {name!r}; available plugins: {', '.join(available) or 'none'} "
            "(see `rollcall task plugins`)"
        )


@dataclass(frozen=True)
class PluginInfo:
    name: str
    source: str  # "builtin", "benchmark" (a built-in timing model), "agent" or the distribution
    target: str  # "module:Class"


def available() -> dict[str, PluginInfo]:
    return dict(_available())


@functools.cache
def _available() -> dict[str, PluginInfo]:
    """Discovered once per process: reading every installed distribution's entry points takes
    milliseconds, and claims and seeding look plugins up all the time (a plugin installed
    later is found by processes started later)."""
    found = {n: PluginInfo(n, "builtin", t) for n, t in BUILTIN.items()}
    found |= {n: PluginInfo(n, "benchmark", t) for n, t in BENCHMARK.items()}
    found |= {n: PluginInfo(n, "agent", t) for n, t in AGENT.items()}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found:
            continue  # built-ins cannot be shadowed
        dist = ep.dist.name if ep.dist is not None else "unknown"
        found[ep.name] = PluginInfo(ep.name, dist, ep.value)
    return dict(sorted(found.items()))


def plugin(name: str) -> TaskPlugin:
    """The plugin named ``name`` (a task with tools and a reward: not ``agent``)."""
    task = get(name)
    if not isinstance(task, TaskPlugin):
        raise TypeError(f"task {name!r} is not a plugin: it has no tools and reward of its own")
    return task


def get(name: str) -> Task:
    """The task named ``name``: the agent task (``agent``) or a plugin (``TaskPlugin``)."""
    infos = _available()
    info = infos.get(name)
    if info is None:
        raise UnknownPluginError(name, list(infos))
    module_name, _, attr = info.target.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    plugin = cls()
    agent = info.source == "agent"
    if not isinstance(plugin, Task if agent else TaskPlugin) or plugin.name != name:
        raise TypeError(f"task plugin {name!r} ({info.target}) does not implement TaskPlugin")
    return plugin
