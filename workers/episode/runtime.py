"""The episode runtime: an agent function run durably, the context it calls, the record of its
calls, replay.

``AgentRun`` plays one sample of any task: a user's agent function (an agent task), or a
built-in plugin through its adapter (``rollcall.workers.episode.plugin``), an agent function
too. ``run(resume, on_turn) -> Played`` builds a ``Trajectory``, checkpointed by the rollout
node after every call through ``on_turn`` (fenced by the lease epoch).

The record (``Trajectory.state["journal"]``) holds one entry per call, in call order: its kind
(``chat``, ``tool``, ``step``), a fingerprint of what was asked (the messages, the tool and its
arguments, the function and its arguments) and its result. A trained ``chat`` call's result is
a span of the trajectory's own tokens (what the engine generated, with its log-probs and policy
version), so nothing is stored twice. Given a checkpoint, ``run`` calls the function again from
the start and answers each call from the record while it lasts, checking that the call asked
for is the one recorded and that the tokens rebuilt equal the tokens checkpointed; the first
call past the record is served live. A call that differs from the record (the function is not
deterministic given the recorded results) is a divergence: reported, counted, and the sample is
restarted from scratch with an empty record, never trained on as it was.

The record and replay machinery is ``journal.py`` (checkpointed append-only), the threads
calls run on ``threads.py``, the normalising of messages and tools ``messages.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import numbers
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from rollcall.orchestrator.domain import JOURNAL
from rollcall.tasks.agent import AgentSpec, AgentSpecError, load_agent
from rollcall.tasks.base import TaskSpec
from rollcall.workers.episode.api import (
    ContextLimit,
    Outcome,
    ReplayDivergence,
)
from rollcall.workers.episode.chat import Chat
from rollcall.workers.episode.context import AgentContext
from rollcall.workers.episode.endpoint import registered, shared_endpoint
from rollcall.workers.episode.engine import Engine, GenerationRequest
from rollcall.workers.episode.journal import CallStats
from rollcall.workers.episode.tools import DEFAULT_TIMEOUT_S, ToolRunner
from rollcall.workers.episode.trajectory import Limits, Played, Trajectory
from rollcall.workers.episode.usercode import (
    UserCodeError,
    check_json,
    check_reward,
    code_location,
    stack_location,
)

log = logging.getLogger(__name__)

# After its episode timeout an agent is cancelled; one whose thread is blocked (synchronous
# work that never awaits) cannot be, and is abandoned this many seconds later.
CANCEL_GRACE_S = 5.0


class _CallFailed(Exception):
    """Calling the agent function itself failed (``fn(ctx, prompt)`` raised ``TypeError``
    before its body ran): it cannot be called so on any input."""


class AgentRun:
    """One sample of a task, played (or replayed) by its agent function: ``fn``, or the agent
    task's (``spec.agent``, loaded on ``run``)."""

    def __init__(
        self,
        engine: Engine,
        chat: Chat,
        spec: TaskSpec,
        prompt: dict[str, Any],
        tools: ToolRunner,
        limits: Limits,
        *,
        fn: Callable[..., Any] | None = None,
        endpoint_host: str = "127.0.0.1",
        on_divergence: Callable[[str, int], None] | None = None,
        episode_id: int | None = None,
        sample_index: int = 0,
    ) -> None:
        if fn is None and not isinstance(spec, AgentSpec):
            raise TypeError("AgentRun needs an agent function or an agent task's spec")
        self.fn = fn
        # an agent's tool and step calls' default timeout (its spec's; a plugin's, its runner's)
        default = getattr(tools, "timeout_s", DEFAULT_TIMEOUT_S)
        self.tool_timeout_s = float(getattr(spec, "tool_timeout_s", default))
        self.episode_id = episode_id
        self.sample_index = sample_index
        self.engine = engine
        self.chat = chat
        self.spec = spec
        self.prompt = prompt
        self.tools = tools
        self.limits = limits
        self.endpoint_host = endpoint_host
        self.on_divergence = on_divergence
        self.stats = CallStats()
        self.divergences = 0
        self.abandoned = False  # a run of the function could not be cancelled: left behind

    def endpoint_url(self) -> str:

        return shared_endpoint(self.endpoint_host).url

    def generate(self, context: list[int], budget: int) -> Any:
        request = GenerationRequest(
            list(context), budget, self.limits.temperature, self.limits.seed
        )
        return self.engine.generate([request])[0]

    def run(
        self,
        resume: Any = None,
        on_turn: Callable[[Trajectory], None] | None = None,
    ) -> Played:
        if self.fn is not None:
            fn = self.fn
        else:
            assert isinstance(self.spec, AgentSpec)
            try:
                fn = load_agent(self.spec.agent)
            except AgentSpecError as e:  # it does not import here (its file or a module)
                raise UserCodeError(str(e), kind="raised", head="the agent does not load") from e
        saved = Trajectory.from_payload(resume) if resume is not None else None
        record = list(saved.state.get(JOURNAL, [])) if saved is not None else []
        while True:
            ctx = AgentContext(self, record, saved, on_turn)
            reward, stop, info = self._play(fn, ctx)
            self.stats.replayed += ctx.stats.replayed
            self.stats.live += ctx.stats.live
            self.stats.generated += ctx.stats.generated
            if ctx.diverged is None and ctx._pos < len(record):
                ctx.diverged = (
                    f"the agent returned after {ctx._pos} calls on replay, but the record holds "
                    f"{len(record)}"
                )
            if ctx.diverged is None:
                break
            self.divergences += 1
            lost = sum(1 for e in record if e.get("k") == "chat")
            log.warning("agent replay diverged (%s); restarting the sample", ctx.diverged)
            if self.on_divergence is not None:
                self.on_divergence(ctx.diverged, lost)
            record, saved = [], None
        t = ctx.trajectory
        t.finished, t.stop_reason = True, ctx._stop_reason or stop
        calls = {"replayed": ctx.stats.replayed, "live": ctx.stats.live}
        env = ctx._env_state or {}  # a plugin's state as its episode ended
        t.state = {**env, **t.state, "calls": calls, **({"info": info} if info else {})}
        return Played(t, reward, len(t.turn_offsets))

    def _play(self, fn: Callable[..., Any], ctx: AgentContext) -> tuple[float, str, dict[str, Any]]:
        """Run the function once: (reward, stop reason, info). What fails in the user's code
        (an exception, a reward that is not a finite number, a wrong return type, the episode
        timeout) is ``UserCodeError``: the episode's failure. The engine's or the lease's
        failure passes as it is, also when the agent caught it."""
        try:
            result = self._call(fn, ctx)
        except ReplayDivergence:
            return 0.0, "diverged", {}
        except ContextLimit as e:
            if ctx.diverged is not None:
                return 0.0, "diverged", {}
            return 0.0, f"limit: {e}", {}
        except BaseException as e:
            if ctx.diverged is not None:
                return 0.0, "diverged", {}
            if ctx.failure is not None:  # the endpoint's call failed (engine, lease): that
                raise ctx.failure from None  # is the failure, not the agent's reaction to it
            if isinstance(e, UserCodeError | KeyboardInterrupt):
                raise
            if isinstance(e, _CallFailed):
                cause = e.__cause__ or e
                raise UserCodeError.raised("the agent", cause, fn, input_independent=True) from e
            # anything else came out of the agent's own thread: CancelledError, SystemExit too
            raise UserCodeError.raised("the agent", e, fn) from e
        finally:
            ctx.closed = ctx.closed or "it returned"
        if ctx.diverged is not None:
            return 0.0, "diverged", {}
        if ctx.failure is not None:  # the agent caught the engine's or the lease's failure
            raise ctx.failure
        if isinstance(result, Outcome):
            reward = check_reward(result.reward, "the agent's reward", fn)
            info = result.info
            if not isinstance(info, dict):
                raise UserCodeError(
                    f"the agent's Outcome.info is a {type(info).__name__}, not a dict",
                    location=code_location(fn),
                    kind="returned",
                    head="the agent's Outcome.info is not a dict",
                )
            check_json(info, "the agent's Outcome.info", fn)
            return reward, "returned", dict(info)
        if isinstance(result, numbers.Real) and not isinstance(result, bool):
            return check_reward(result, "the agent's reward", fn), "returned", {}
        raise UserCodeError(
            f"the agent {self._name(fn)} returned {type(result).__name__}, not an Outcome (or "
            "a number)",
            location=code_location(fn),
            kind="returned",
            head=f"the agent returned {type(result).__name__}",
            # a value of the wrong type is a programming error; None may be a branch that
            # forgot its return, taken on some inputs only
            input_independent=result is not None,
        )

    def _name(self, fn: Callable[..., Any]) -> str:
        """The agent function as the user named it (an agent task's ``spec.agent``)."""
        if isinstance(self.spec, AgentSpec):
            return self.spec.agent
        return str(getattr(fn, "__qualname__", fn))

    def _call(self, fn: Callable[..., Any], ctx: AgentContext) -> Any:
        """``await fn(ctx, prompt)`` on an event loop of its own thread, within the task's
        ``episode_timeout_s``: past it the function is cancelled (``UserCodeError``, where it
        was waiting); a function that cannot be cancelled (its thread blocked in synchronous
        code) is abandoned ``CANCEL_GRACE_S`` later, its calls through ``ctx`` refused."""
        if not isinstance(self.spec, AgentSpec):  # a built-in plugin's adapter
            return self._call_plugin(fn, ctx)
        timeout = float(self.spec.episode_timeout_s)
        expired: list[BaseException] = []

        async def main() -> Any:
            deadline = asyncio.timeout(timeout)
            coroutine = self._coroutine(fn, ctx)
            try:
                async with deadline:
                    result = await coroutine
            except TimeoutError as e:
                if not deadline.expired():
                    raise  # the agent's own (a ctx.step's timeout, say)
                expired.append(e.__context__ or e)  # the cancellation: where the agent waited
                return None
            if deadline.expired():  # it swallowed the cancellation
                expired.append(TimeoutError())
            return result

        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def target() -> None:
            try:
                with registered(ctx):
                    done.set_result(asyncio.run(main()))
            except BaseException as e:
                done.set_exception(e)

        thread = threading.Thread(target=target, daemon=True, name="agent-episode")
        thread.start()
        concurrent.futures.wait([done], timeout=timeout + CANCEL_GRACE_S)
        if not done.done():
            frame = sys._current_frames().get(thread.ident or 0)
            ctx.closed = f"it did not finish within {timeout:g} s"
            stack = traceback.extract_stack(frame) if frame is not None else []
            self.abandoned = True
            raise UserCodeError(
                f"the agent did not finish within {timeout:g} s (spec.episode_timeout_s) and "
                f"could not be cancelled within {CANCEL_GRACE_S:g} s more: its thread is blocked "
                "in synchronous code (a blocking call, time.sleep, a busy loop; run it with "
                "ctx.step or ctx.tool) or waits for a thread it started; the thread is abandoned",
                location=stack_location(stack) or code_location(fn),
                trace="".join(traceback.format_list(stack)),
                kind="timeout",
                head=f"the agent did not finish within {timeout:g} s",
            )
        result = done.result()
        if expired:
            ctx.closed = f"it did not finish within {timeout:g} s"
            waited = expired[0]
            error = UserCodeError.raised("the agent", waited, fn)
            raise UserCodeError(
                f"the agent did not finish within {timeout:g} s (spec.episode_timeout_s) and was "
                "cancelled",
                location=error.location,
                trace=error.trace,
                kind="timeout",
                head=f"the agent did not finish within {timeout:g} s",
            )
        return result

    def _coroutine(self, fn: Callable[..., Any], ctx: AgentContext) -> Any:
        """``fn(ctx, prompt)``: the coroutine to run; ``_CallFailed`` when ``fn`` cannot be
        called so (on every input)."""
        try:
            return fn(ctx, dict(self.prompt))
        except TypeError as e:
            raise _CallFailed(e) from e

    def _call_plugin(self, fn: Callable[..., Any], ctx: AgentContext) -> Any:
        """A built-in plugin's adapter (``plugin.py``) on the caller's thread, with no event
        loop: it never awaits (its calls are ``chat_sync`` and recorded tool calls) and has no
        episode timeout, so its coroutine runs to its end at the first step, without the
        thread and loop an agent function's run costs (about a millisecond per episode)."""
        coroutine = self._coroutine(fn, ctx)
        with registered(ctx):
            try:
                coroutine.send(None)
            except StopIteration as end:
                return end.value
        coroutine.close()
        raise RuntimeError(f"{self._name(fn)} awaited: a plugin's adapter must not")
