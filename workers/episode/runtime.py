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
import json
import logging
import numbers
import secrets
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from rollcall.orchestrator.domain import JOURNAL
from rollcall.orchestrator.inputs import json_bytes, text_bytes, too_big
from rollcall.tasks.agent import AgentSpec, AgentSpecError, load_agent
from rollcall.tasks.base import TaskSpec, Tool
from rollcall.workers.episode.api import (
    AgentUsageError,
    ContextLimit,
    Outcome,
    ReplayDivergence,
    Reply,
    ToolCall,
)
from rollcall.workers.episode.chat import Chat
from rollcall.workers.episode.engine import Engine, GenerationRequest
from rollcall.workers.episode.journal import CallStats, Recorder, fingerprint
from rollcall.workers.episode.messages import (
    as_message,
    as_text,
    reply_of,
    tools_of,
    with_tool_text,
)
from rollcall.workers.episode.threads import bounded, in_thread, run_tool
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


class AgentContext(Recorder):
    """What an agent function calls: ``chat`` (the policy, through the rollout engine),
    ``tool`` (a tool with a timeout, optionally in its own process), ``step`` (any other
    function whose result must be the same on replay, e.g. a reward). Every call is recorded
    before its result is returned; the calls of one episode must not overlap (await each).

    ``prompt`` is the episode's prompt, ``episode_id`` and ``sample_index`` which sample of
    which episode this is; ``base_url`` and ``api_key`` address this node's
    OpenAI-compatible endpoint for this episode (``openai.AsyncOpenAI(base_url=ctx.base_url,
    api_key=ctx.api_key)``): its calls are recorded exactly as ``chat`` calls are."""

    def __init__(
        self,
        run: AgentRun,
        record: list[dict[str, Any]],
        saved: Trajectory | None,
        on_call: Callable[[Trajectory], None] | None,
    ) -> None:
        super().__init__(record, on_call)
        self.prompt = run.prompt
        self.episode_id = run.episode_id  # the episode (None outside a rollout node)
        self.sample_index = run.sample_index  # which sample of the episode's group this is
        self._run = run
        self._saved = saved
        self._conv: list[dict[str, Any]] | None = None  # the trained conversation, as given
        self._render: list[dict[str, Any]] = []  # ... as rendered (with the tools' system text)
        self._conv_tools: list[Tool] = []
        self._ended = True
        self.api_key = f"rc-{secrets.token_urlsafe(18)}"
        # set by the built-in plugins' adapter (``plugin.py``): its messages come as rendered
        # (the format's system text in them) and a turn that a limit refuses keeps its
        # segment; the episode's stop reason and the environment's state as it ended
        self._as_rendered = False
        self._stop_reason: str | None = None
        self._env_state: dict[str, Any] | None = None

    # -- public API ---------------------------------------------------------------------

    @property
    def replaying(self) -> bool:
        """Whether the next call will be answered from the record."""
        return self._pos < len(self._record)

    @property
    def limits(self) -> Limits:
        """The episode's limits: turns and tokens, and the most bytes of each untrusted input
        (``rollout.input_limits``)."""
        return self._run.limits

    @property
    def base_url(self) -> str:
        """This node's OpenAI-compatible endpoint (``/v1``), started on first use."""
        return self._run.endpoint_url()

    async def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[Any] | None = None,
        *,
        train: bool = True,
        max_tokens: int | None = None,
    ) -> Reply:
        """One generated assistant turn for ``messages``, in the model's chat template.

        ``train=True`` (the default): the turn belongs to the trained trajectory. The first such
        call starts the conversation; each later one must extend it (the earlier messages and
        replies as they were, then one or more new user or tool messages). The tools are those
        of the first call. ``train=False``: a separate conversation (e.g. a judge), generated by
        the same engine and recorded, but not trained on."""
        return await in_thread(self.chat_sync, messages, tools, train, max_tokens)

    async def tool(
        self,
        fn: Any,
        call: ToolCall,
        *,
        timeout_s: float | None = None,
        isolate: bool = False,
        on_error: str = "observe",
    ) -> dict[str, Any]:
        """Run the tool ``call`` names with its arguments: ``fn`` is the callable (sync or
        async) or a dict of them by tool name. Returns the tool message to append
        (``{"role": "tool", "tool_call_id": ..., "content": ...}``). Within ``timeout_s``
        (default: the task's ``tool_timeout_s``); ``isolate=True`` runs it in the node's tool
        process (killed when it hangs). An error (an exception, a timeout, an unknown tool,
        arguments that are not an object) becomes an ``error: ...`` observation, or with
        ``on_error="raise"`` fails the episode."""
        if on_error not in ("observe", "raise"):
            raise AgentUsageError("ctx.tool: on_error must be 'observe' or 'raise'")
        target = fn.get(call.name) if isinstance(fn, dict) else fn
        name = getattr(target, "__qualname__", call.name) if target is not None else call.name
        key = fingerprint("tool", name, call.name, call.arguments)
        async with self._call("tool", key, call.name) as slot:
            if slot.entry is not None:
                content = str(slot.entry["r"]["c"])
            else:
                limits = self._run.limits
                size = json_bytes(call.arguments)
                if size > limits.tool_arguments_bytes:
                    ok, value = False, too_big(
                        f"the arguments of the call to {call.name[:64]!r}", size,
                        "tool_arguments_bytes", limits.tool_arguments_bytes,
                    )  # fmt: skip
                else:
                    timeout = self._run.tool_timeout_s if timeout_s is None else timeout_s
                    ok, value = await run_tool(
                        target, call, fn, timeout, runner=self._run.tools if isolate else None,
                        network=limits.network,
                    )  # fmt: skip
                if ok:
                    value = as_text(value)
                    if (size := text_bytes(value)) > limits.observation_bytes:
                        ok, value = False, too_big(
                            "the tool's observation", size, "observation_bytes",
                            limits.observation_bytes,
                        )  # fmt: skip
                if not ok and on_error == "raise":
                    raise AgentUsageError(f"the tool {call.name!r} failed: {value}")
                content = value if ok else f"error: {value}"
                slot.result = {"c": content}
        return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}

    async def step(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` (sync or async; e.g. a reward, an LLM judge, an HTTP
        verifier), its result recorded so replay returns the same. The result must be
        JSON-serialisable. An exception from ``fn`` propagates (nothing is recorded); a
        ``timeout_s=`` keyword (default: the task's ``tool_timeout_s``) bounds it."""
        timeout = float(kwargs.pop("timeout_s", self._run.tool_timeout_s))
        name = getattr(fn, "__qualname__", type(fn).__qualname__)
        key = fingerprint("step", name, args, kwargs)
        async with self._call("step", key, name) as slot:
            if slot.entry is not None:
                return slot.entry["r"]["v"]
            value = await bounded(fn, args, kwargs, timeout)
            try:  # what replay returns is the value read back from JSON: so is the live one
                text = json.dumps(value, allow_nan=False)
                limit = self._run.limits.step_result_bytes
                if (size := text_bytes(text)) > limit:
                    raise AgentUsageError(
                        f"ctx.step({name}): "
                        + too_big("its result", size, "step_result_bytes", limit)
                    )
                value = json.loads(text)
            except (TypeError, ValueError) as e:
                what = (
                    "a number that is not finite (NaN or infinity)"
                    if "Out of range float" in str(e)
                    else type(value).__name__
                )
                raise AgentUsageError(
                    f"ctx.step({name}): its result must be JSON-serialisable with finite numbers "
                    f"to be recorded; got {what}"
                ) from None
            slot.result = {"v": value}
            return value

    def _recorded(
        self, kind: str, key: str, detail: str, live: Callable[[], Any], *, defer: bool = False
    ) -> Any:
        """A call of ``kind`` answered from the record, or ``live()`` recorded, on the caller's
        thread (the plugins' adapter: it has no episode timeout to be cancelled by);
        ``defer``: checkpointed with the next call (``Slot.defer``)."""
        with self._sync_call(kind, key, detail) as slot:
            if slot.entry is not None:
                return slot.entry["r"]
            slot.defer = defer
            slot.result = live()
            return slot.result

    # -- chat ---------------------------------------------------------------------------

    def chat_sync(
        self,
        messages: list[dict[str, Any]],
        tools: list[Any] | None = None,
        train: bool = True,
        max_tokens: int | None = None,
    ) -> Reply:
        """``chat`` for callers on threads (the OpenAI endpoint)."""
        if not isinstance(messages, list) or not messages:
            raise AgentUsageError("ctx.chat needs a non-empty list of messages")
        msgs = [as_message(m, "ctx.chat") for m in messages]
        tool_list = tools_of(tools)
        key = fingerprint("chat", train, msgs, [t.to_json() for t in tool_list], max_tokens)
        with self._sync_call("chat", key, f"({len(msgs)} messages)") as slot:
            if train:
                reply, result = self._trained(msgs, tool_list, max_tokens, slot.entry)
            else:
                reply, result = self._untrained(msgs, tool_list, max_tokens, slot.entry)
            if slot.entry is None:
                slot.result = result
            return reply

    def _budget(self, extra: int, max_tokens: int | None, trained: bool) -> int:
        limits = self._run.limits
        per_turn = limits.max_tokens_per_turn
        if max_tokens is not None:
            per_turn = max(1, min(per_turn, int(max_tokens)))
        if not trained:
            return per_turn
        if len(self.trajectory.turn_offsets) >= limits.max_turns:
            raise ContextLimit(
                f"the trajectory has its {limits.max_turns} trained turns (the task's max_turns)"
            )
        room = limits.max_tokens - len(self.trajectory.token_ids) - extra
        if room <= 0 and not self.trajectory.token_ids:
            raise ContextLimit(
                f"the prompt alone is {extra} tokens, at or over rollout.max_tokens "
                f"({limits.max_tokens})"
            )
        if room <= 0:
            raise ContextLimit(
                f"the trajectory reached rollout.max_tokens ({limits.max_tokens} tokens)"
            )
        return min(per_turn, room)

    def _trained(
        self,
        msgs: list[dict[str, Any]],
        tools: list[Tool],
        max_tokens: int | None,
        entry: dict[str, Any] | None,
    ) -> tuple[Reply, dict[str, Any]]:
        chat, t = self._run.chat, self.trajectory
        if self._conv is None:
            render = msgs if self._as_rendered else with_tool_text(self._run.chat, msgs, tools)
            segment = chat.messages_ids(render, tools)
            self._conv_tools = tools
        else:
            n = len(self._conv)
            for i, (was, now) in enumerate(zip(self._conv, msgs, strict=False)):
                same = was["role"] == now["role"] and (
                    was["role"] == "assistant" or was["content"] == now["content"]
                )
                if not same:
                    raise AgentUsageError(
                        f"ctx.chat: message {i} differs from the trained conversation so far; "
                        "a trained conversation must be extended, not rewritten (train=False "
                        "for a separate one)"
                    )
            new = msgs[n:]
            if len(msgs) <= n or any(m["role"] == "assistant" for m in new):
                raise AgentUsageError(
                    "ctx.chat: a trained call must add one or more user or tool messages after "
                    "the last reply (and no assistant message)"
                )
            render = [*self._render, *new]
            segment = chat.extension_ids(self._render, new, self._conv_tools, ended=self._ended)
        try:
            budget = self._budget(len(segment), max_tokens, trained=True)
        except ContextLimit:
            if self._as_rendered:  # the plugins' trajectories end with what the model was told
                t.append(segment, generated=False)
                if self._conv is None:
                    t.prompt_tokens = len(segment)
            raise
        start = len(t.token_ids) + len(segment)
        if entry is not None:
            r = entry["r"]
            saved = self._saved
            if (
                saved is None
                or r.get("s") != start
                or saved.token_ids[len(t.token_ids) : start] != segment
            ):
                self._diverge(
                    "the conversation rebuilt on replay differs from the checkpointed tokens "
                    f"before chat call {self._pos}"
                )
            assert saved is not None
            ids = saved.token_ids[r["s"] : r["e"]]
            logprobs = saved.logprobs[r["s"] : r["e"]]
            finish, version = str(r["f"]), int(r["v"])
        else:
            gen = self._generate(t.token_ids + segment, budget)
            ids, logprobs, finish, version = (
                gen.token_ids,
                gen.logprobs,
                gen.finish_reason,
                gen.version,
            )
            self.stats.generated += 1
        t.append(segment, generated=False)
        if self._conv is None:
            t.prompt_tokens = len(segment)
        t.turn_offsets.append(len(t.token_ids))
        t.turn_versions.append(version)
        t.append(list(ids), generated=True, logprobs=list(logprobs))
        reply = reply_of(self._run.chat, len(self._journal), ids, finish, version)
        self._conv = [*msgs, {"role": "assistant", "content": reply.message.get("content") or ""}]
        self._render = [*render, {"role": "assistant", "content": ""}]
        self._ended = finish == "stop"
        t.answer = reply.answer  # the last trained turn's answer, shown with the sample
        return reply, {"s": start, "e": start + len(ids), "f": finish, "v": version}

    def _untrained(
        self,
        msgs: list[dict[str, Any]],
        tools: list[Tool],
        max_tokens: int | None,
        entry: dict[str, Any] | None,
    ) -> tuple[Reply, dict[str, Any]]:
        if entry is not None:
            r = entry["r"]
            return reply_of(
                self._run.chat, len(self._journal), list(r["t"]), str(r["f"]), int(r["v"])
            ), r
        ids = self._run.chat.messages_ids(with_tool_text(self._run.chat, msgs, tools), tools)
        gen = self._generate(ids, self._budget(0, max_tokens, trained=False))
        self.stats.generated += 1
        result = {"t": gen.token_ids, "f": gen.finish_reason, "v": gen.version}
        return reply_of(
            self._run.chat, len(self._journal), gen.token_ids, gen.finish_reason, gen.version
        ), result

    def _generate(self, context: list[int], budget: int) -> Any:
        """The engine's generation; its failure is the node's, whatever the agent does with it
        (an agent that catches it still ends the episode as the engine's failure)."""
        try:
            return self._run.generate(context, budget)
        except BaseException as e:
            self.failure = e
            raise


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
        from rollcall.workers.episode.endpoint import shared_endpoint

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
        from rollcall.workers.episode.endpoint import registered

        given = getattr(self.spec, "episode_timeout_s", None)  # a plugin's episodes: none
        timeout = None if given is None else float(given)
        expired: list[BaseException] = []

        async def main() -> Any:
            deadline = asyncio.timeout(timeout)
            try:
                coroutine = fn(ctx, dict(self.prompt))
            except TypeError as e:  # it cannot be called as fn(ctx, prompt): on every input
                raise _CallFailed(e) from e
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
        concurrent.futures.wait(
            [done], timeout=None if timeout is None else timeout + CANCEL_GRACE_S
        )
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
