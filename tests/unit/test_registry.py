from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollcall.tasks import registry
from rollcall.tasks.base import TaskPlugin
from rollcall.tasks.echo import EchoSpec


def test_echo_is_registered_and_implements_protocol() -> None:
    assert "echo" in registry.available()
    plugin = registry.get("echo")
    assert isinstance(plugin, TaskPlugin)
    assert plugin.name == "echo"


def test_unknown_plugin_lists_available() -> None:
    with pytest.raises(
        registry.UnknownPluginError, match="available plugins: agent, calculator, echo"
    ):
        registry.get("rollcall.tasks.echo:EchoTask")  # an import path is not a plugin name


def test_echo_prompt_stream_is_deterministic_and_seeded() -> None:
    plugin = registry.get("echo")
    spec = EchoSpec(seed=7)
    first = [plugin.prompt(spec, i) for i in range(20)]
    again = [plugin.prompt(spec, i) for i in range(20)]
    other_seed = [plugin.prompt(EchoSpec(seed=8), i) for i in range(20)]
    assert first == again
    assert first != other_seed
    assert len({p["target"] for p in first}) > 5


def test_echo_reward() -> None:
    plugin = registry.plugin("echo")
    spec = EchoSpec()
    prompt = {"target": "alpha bravo"}
    assert plugin.reward(spec, prompt, "alpha bravo\n", {}, 1) == 1.0
    assert plugin.reward(spec, prompt, "alpha", {}, 1) == 0.0
    assert plugin.reward(spec, prompt, None, {}, 1) == 0.0


def test_echo_spec_validation() -> None:
    with pytest.raises(ValidationError, match="max_length must be at least min_length"):
        EchoSpec(min_length=5, max_length=2)
    with pytest.raises(ValidationError, match="Extra inputs"):
        EchoSpec.model_validate({"group_sise": 4})
    with pytest.raises(ValidationError):
        EchoSpec(group_size=0)


def test_plugins_are_discovered_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Claims and seeding look plugins up all the time; reading the installed distributions'
    entry points each time cost milliseconds per lookup."""
    calls = []

    def counting(**kw: object) -> list[object]:
        calls.append(kw)
        return []

    monkeypatch.setattr(registry, "entry_points", counting)
    registry._available.cache_clear()
    try:
        for _ in range(5):
            registry.get("echo")
            registry.available()
        assert len(calls) == 1
    finally:
        registry._available.cache_clear()


def test_the_agent_task_is_a_task_and_not_a_plugin() -> None:
    """An agent's tools and reward are its agent function's: its task has none to call."""
    from rollcall.tasks.base import Task, TaskPlugin

    agent = registry.get("agent")
    assert isinstance(agent, Task) and not isinstance(agent, TaskPlugin)
    with pytest.raises(TypeError, match="not a plugin"):
        registry.plugin("agent")
