"""Tools run with a timeout and in isolation: hangs, exceptions, crashes and malformed calls
become error observations; the runner survives them."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, ClassVar

import pytest

from rollcall.tasks.base import BaseTask, Observation, TaskSpec, Tool
from rollcall.tasks.calculator import CalculatorSpec, CalculatorTask
from rollcall.workers.episode.tools import ToolRunner

# A lock of the node's, held by one of its threads (an agent loop, the heartbeat) while the
# tool process starts; a tool takes it.
NODE_LOCK = threading.Lock()


class NastyTask(BaseTask):
    """A fake plugin whose tools misbehave on purpose (named a fake: it exists for this test)."""

    name: ClassVar[str] = "nasty"
    description: ClassVar[str] = "misbehaving tools"
    Spec: ClassVar[type[TaskSpec]] = TaskSpec

    def prompt(self, spec: TaskSpec, index: int) -> dict[str, Any]:
        return {}

    def eval_prompt(self, spec: TaskSpec, index: int) -> dict[str, Any]:
        return {}

    def instructions(self, spec: TaskSpec, prompt: dict[str, Any]) -> str:
        return ""

    def reward(
        self,
        spec: TaskSpec,
        prompt: dict[str, Any],
        answer: str | None,
        state: dict[str, Any],
        turns: int,
    ) -> float:
        return 0.0

    def tools(self, spec: TaskSpec) -> list[Tool]:
        return [
            Tool(n, n, {"type": "object", "required": []})
            for n in ("hang", "boom", "die", "hog", "ok", "locked")
        ]

    def call_tool(
        self,
        spec: TaskSpec,
        prompt: dict[str, Any],
        state: dict[str, Any],
        name: str,
        arguments: dict[str, Any],
    ) -> Observation:
        if name == "hang":
            time.sleep(3600)
        if name == "boom":
            raise RuntimeError("kaboom")
        if name == "die":
            os._exit(3)
        if name == "hog":
            _ = bytearray(4 * 1024**3)
        if name == "ok":
            return Observation("fine", {"n": state.get("n", 0) + 1})
        if name == "locked":
            with NODE_LOCK:
                return Observation("got the lock", state)
        return super().call_tool(spec, prompt, state, name, arguments)


@pytest.fixture
def runner() -> Any:
    r = ToolRunner(timeout_s=1.0, memory_mb=512)
    yield r
    r.close()


def test_timeout_crash_and_exception_become_observations(runner: ToolRunner) -> None:
    task, spec = NastyTask(), TaskSpec()
    t0 = time.monotonic()
    r = runner.call(task, spec, {}, {"n": 1}, "hang", {})
    assert r.error and "did not answer within 1 s" in r.observation and r.state == {"n": 1}
    assert time.monotonic() - t0 < 5
    r = runner.call(task, spec, {}, {"n": 1}, "boom", {})
    assert r.error and "RuntimeError: kaboom" in r.observation
    r = runner.call(task, spec, {}, {"n": 1}, "die", {})
    assert r.error and "crashed" in r.observation
    r = runner.call(task, spec, {}, {"n": 1}, "hog", {})
    assert r.error and "out of memory" in r.observation
    r = runner.call(task, spec, {}, {"n": 1}, "nope", {})
    assert r.error and "unknown tool 'nope'" in r.observation
    r = runner.call(task, spec, {}, {"n": 1}, "ok", ["not", "a", "dict"])
    assert r.error and "JSON object" in r.observation
    # After all that, the runner still works (the hung and dead children were replaced).
    r = runner.call(task, spec, {}, {"n": 1}, "ok", {})
    assert (r.observation, r.state, r.error) == ("fine", {"n": 2}, False)
    assert runner.restarts == 2


def test_real_tool_through_the_runner(runner: ToolRunner) -> None:
    task, spec = CalculatorTask(), CalculatorSpec()
    r = runner.call(task, spec, {"answer": "1"}, {}, "calc", {"expression": "6 * 7"})
    assert (r.observation, r.state, r.done, r.error) == ("42", {"calc_calls": 1}, False, False)
    r = runner.call(task, spec, {"answer": "1"}, {}, "calc", {"expr": "6 * 7"})
    assert r.error and "missing argument(s): expression" in r.observation


def test_the_tool_process_inherits_no_lock_of_the_nodes_threads(runner: ToolRunner) -> None:
    """A rollout node has threads; a fork would copy a lock one of them holds into the tool
    process, held there forever (no thread to release it), and the tool would hang. The
    runner's process starts from a clean interpreter (forkserver), with the same timeouts."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with NODE_LOCK:
            holding.set()
            release.wait(60)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert holding.wait(10)
    try:
        r = runner.call(NastyTask(), TaskSpec(), {}, {}, "locked", {})
    finally:
        release.set()
        t.join(timeout=10)
    assert (r.observation, r.error) == ("got the lock", False)
    assert runner.start_method != "fork"
