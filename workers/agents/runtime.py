"""Running an agent function durably: the context it calls, the record of its calls, replay.

``AgentRun`` plays one sample of an agent task with the same interface as the plugin loop
(``AgentLoop``): ``run(resume, on_turn) -> Outcome`` over a ``Trajectory``, checkpointed by the
rollout node after every call through ``on_turn`` (fenced by the lease epoch).

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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import inspect
import json
import logging
import numbers
import secrets
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tasks.agent import (
    AGENT_FILE_MODULE,
    DEFAULT_EPISODE_TIMEOUT_S,
    AgentSpec,
    AgentSpecError,
    load_agent,
)
from tasks.base import Tool
from workers.agents.api import (
    AgentUsageError,
    ContextLimit,
    Outcome,
    ReplayDivergence,
    Reply,
    ToolCall,
)
from workers.rollout.agent import Limits, Trajectory
from workers.rollout.agent import Outcome as LoopOutcome
from workers.rollout.chat import Chat
from workers.rollout.engines.base import Engine, GenerationRequest
from workers.rollout.toolcalls import Answer, Malformed
from workers.rollout.toolcalls import ToolCall as ParsedCall
from workers.rollout.tools import ToolRunner
from workers.rollout.usercode import (
    UserCodeError,
    check_json,
    check_reward,
    code_location,
    stack_location,
)

log = logging.getLogger(__name__)

JOURNAL = "journal"
# After its episode timeout an agent is cancelled; one whose thread is blocked (synchronous
# work that never awaits) cannot be, and is abandoned this many seconds later.
CANCEL_GRACE_S = 5.0


def _stable(value: Any) -> Any:
    """What a fingerprint sees of a value JSON cannot hold: its type, never its address."""
    name = getattr(value, "__qualname__", None) or type(value).__qualname__
    return f"<{name}>"


def fingerprint(*parts: Any) -> str:
    text = json.dumps(parts, sort_keys=True, default=_stable)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _content(value: Any) -> str:
    """A message's content as text (OpenAI content parts joined)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in value)
    return str(value)


def _message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise AgentUsageError(f"{where}: every message must be a dict with a 'role'")
    return {"role": m["role"], "content": _content(m.get("content"))}


def _tools(tools: Any) -> list[Tool]:
    """OpenAI-style tool dicts (``{"type": "function", "function": {...}}`` or the function
    dict itself) or ``tasks.base.Tool`` values."""
    out = []
    for t in tools or []:
        if isinstance(t, Tool):
            out.append(t)
            continue
        f = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise AgentUsageError("tools must be OpenAI tool dicts with a function name")
        out.append(
            Tool(
                f["name"],
                str(f.get("description", "")),
                dict(f.get("parameters") or {"type": "object", "properties": {}}),
            )
        )
    return out


def _describe(kind: str, detail: str) -> str:
    return f"{kind} {detail}" if detail else kind


@dataclass
class CallStats:
    replayed: int = 0  # calls answered from the record
    live: int = 0  # calls served now (generated, run)
    generated: int = 0  # of them, chat calls that ran the engine


class AgentContext:
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
        self.prompt = run.prompt
        self.episode_id = run.episode_id  # the episode (None outside a rollout node)
        self.sample_index = run.sample_index  # which sample of the episode's group this is
        self._run = run
        self._record = record
        self._saved = saved
        self._pos = 0
        self._journal: list[dict[str, Any]] = []
        self.trajectory = Trajectory(state={JOURNAL: self._journal})
        self._on_call = on_call
        self._lock = threading.Lock()
        self._busy = False
        self._conv: list[dict[str, Any]] | None = None  # the trained conversation, as given
        self._render: list[dict[str, Any]] = []  # ... as rendered (with the tools' system text)
        self._conv_tools: list[Tool] = []
        self._ended = True
        self.stats = CallStats()
        self.diverged: str | None = None
        self.failure: BaseException | None = None  # what failed a call served on a thread
        self.closed: str | None = None  # the episode ended (timed out): calls are refused
        self.api_key = f"rc-{secrets.token_urlsafe(18)}"

    # -- public API ---------------------------------------------------------------------

    @property
    def replaying(self) -> bool:
        """Whether the next call will be answered from the record."""
        return self._pos < len(self._record)

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
        return await _in_thread(self.chat_sync, messages, tools, train, max_tokens)

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
                ok, value = await self._execute(target, call, fn, timeout_s, isolate=isolate)
                if not ok and on_error == "raise":
                    raise AgentUsageError(f"the tool {call.name!r} failed: {value}")
                content = _text(value) if ok else f"error: {value}"
                slot.result = {"c": content}
        return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}

    async def step(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` (sync or async; e.g. a reward, an LLM judge, an HTTP
        verifier), its result recorded so replay returns the same. The result must be
        JSON-serialisable. An exception from ``fn`` propagates (nothing is recorded); a
        ``timeout_s=`` keyword (default: the task's ``tool_timeout_s``) bounds it."""
        timeout = float(kwargs.pop("timeout_s", self._run.spec.tool_timeout_s))
        name = getattr(fn, "__qualname__", type(fn).__qualname__)
        key = fingerprint("step", name, args, kwargs)
        async with self._call("step", key, name) as slot:
            if slot.entry is not None:
                return slot.entry["r"]["v"]
            value = await _bounded(fn, args, kwargs, timeout)
            try:  # what replay returns is the value read back from JSON: so is the live one
                value = json.loads(json.dumps(value, allow_nan=False))
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
        msgs = [_message(m, "ctx.chat") for m in messages]
        tool_list = _tools(tools)
        key = fingerprint("chat", train, msgs, [t.to_json() for t in tool_list], max_tokens)
        with self._sync_call("chat", key, f"({len(msgs)} messages)") as slot:
            if train:
                reply, result = self._trained(msgs, tool_list, max_tokens, slot.entry)
            else:
                reply, result = self._untrained(msgs, tool_list, max_tokens, slot.entry)
            if slot.entry is None:
                slot.result = result
            return reply

    def _system(self, msgs: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, Any]]:
        """The messages as rendered: how to call the tools (the tool-call format's system text,
        the same the built-in tasks use) in the system message, added when there are tools."""
        chat = self._run.chat
        if not tools:
            return list(msgs)
        text = chat.format.system_text(tools, chat.renders_tools)
        if msgs and msgs[0]["role"] == "system":
            first = {"role": "system", "content": f"{msgs[0]['content']}\n\n{text}"}
            return [first, *msgs[1:]]
        return [{"role": "system", "content": text}, *msgs]

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
            render = self._system(msgs, tools)
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
        budget = self._budget(len(segment), max_tokens, trained=True)
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
        reply = self._reply(ids, finish, version)
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
            return self._reply(list(r["t"]), str(r["f"]), int(r["v"])), r
        ids = self._run.chat.messages_ids(self._system(msgs, tools), tools)
        gen = self._generate(ids, self._budget(0, max_tokens, trained=False))
        self.stats.generated += 1
        result = {"t": gen.token_ids, "f": gen.finish_reason, "v": gen.version}
        return self._reply(gen.token_ids, gen.finish_reason, gen.version), result

    def _generate(self, context: list[int], budget: int) -> Any:
        """The engine's generation; its failure is the node's, whatever the agent does with it
        (an agent that catches it still ends the episode as the engine's failure)."""
        try:
            return self._run.generate(context, budget)
        except BaseException as e:
            self.failure = e
            raise

    def _reply(self, ids: list[int], finish: str, version: int) -> Reply:
        chat = self._run.chat
        body = list(ids)
        if body and body[-1] == chat.eos_id:
            body = body[:-1]
        text = str(chat.tokenizer.decode(body, skip_special_tokens=False))
        action = chat.parse(list(ids)) if finish == "stop" else Malformed("the turn was cut off")
        calls: list[ToolCall] = []
        answer = error = None
        if isinstance(action, ParsedCall):
            calls = [ToolCall(f"call_{len(self._journal)}", action.name, action.arguments)]
        elif isinstance(action, Answer):
            answer = action.text
        else:
            error = action.reason
        message: dict[str, Any] = {"role": "assistant", "content": answer if answer else text}
        if calls:
            message["content"] = None
            message["tool_calls"] = [c.to_openai() for c in calls]
        return Reply(message, text, calls, answer, error, finish, version, len(ids))

    # -- the record ---------------------------------------------------------------------

    def _diverge(self, why: str) -> None:
        self.diverged = why
        raise ReplayDivergence(why)

    def _next(self, kind: str, key: str, detail: str) -> dict[str, Any] | None:
        if self.diverged is not None:
            raise ReplayDivergence(self.diverged)
        if self._pos >= len(self._record):
            return None
        entry = self._record[self._pos]
        if entry.get("k") != kind or entry.get("h") != key:
            self._diverge(
                f"call {self._pos + 1} on replay is {_describe(kind, detail)} but the record "
                f"holds a different {entry.get('k')} call there (the agent is not deterministic "
                "given its recorded results)"
            )
        self._pos += 1
        return entry

    def _finish_call(self, kind: str, key: str, entry: Any, result: Any) -> None:
        if entry is None and result is None:  # the live call raised: nothing to record
            return
        # a new list and state each time: a checkpoint handed out earlier keeps its own
        self._journal = [*self._journal, entry or {"k": kind, "h": key, "r": result}]
        self.trajectory.state = {**self.trajectory.state, JOURNAL: self._journal}
        if entry is not None:
            self.stats.replayed += 1
            return
        self.stats.live += 1
        if self._on_call is not None:
            try:
                self._on_call(self.trajectory)
            except BaseException as e:  # the checkpoint failed or the lease moved on
                self.failure = e
                raise

    def _enter(self) -> None:
        with self._lock:
            if self.closed is not None:
                raise AgentUsageError(f"this episode is over ({self.closed}): no further calls")
            if self._busy:
                raise AgentUsageError(
                    "ctx calls of one episode must not overlap: await each before the next"
                )
            self._busy = True

    @contextmanager
    def _sync_call(self, kind: str, key: str, detail: str) -> Iterator[_Slot]:
        self._enter()
        try:
            slot = _Slot(self._next(kind, key, detail))
            yield slot
            self._finish_call(kind, key, slot.entry, slot.result)
        finally:
            self._busy = False

    def _call(self, kind: str, key: str, detail: str) -> _AsyncSlot:
        return _AsyncSlot(self, kind, key, detail)

    async def _execute(
        self, target: Any, call: ToolCall, fn: Any, timeout_s: float | None, *, isolate: bool
    ) -> tuple[bool, Any]:
        if target is None:
            known = ", ".join(sorted(fn)) if isinstance(fn, dict) else "none"
            return False, f"unknown tool {call.name!r}; available tools: {known}"
        if not isinstance(call.arguments, dict):
            return False, "tool arguments must be a JSON object"
        timeout = float(timeout_s if timeout_s is not None else self._run.spec.tool_timeout_s)
        if isolate:
            runner = self._run.tools
            _by_value(target)
            result: tuple[bool, Any] = await _in_thread(
                runner.call_function, target, (), dict(call.arguments), timeout, call.name
            )
            return result
        try:
            return True, await _bounded(target, (), dict(call.arguments), timeout)
        except TimeoutError:
            return False, f"the tool {call.name!r} did not answer within {timeout:g} s"
        except Exception as e:
            return False, f"{type(e).__name__}: {e}"


@dataclass
class _Slot:
    entry: dict[str, Any] | None
    result: Any = None


class _AsyncSlot:
    def __init__(self, ctx: AgentContext, kind: str, key: str, detail: str) -> None:
        self.ctx, self.kind, self.key, self.detail = ctx, kind, key, detail

    async def __aenter__(self) -> _Slot:
        self.ctx._enter()
        try:
            self.slot = _Slot(self.ctx._next(self.kind, self.key, self.detail))
        except BaseException:
            self.ctx._busy = False
            raise
        return self.slot

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is None:
                await _in_thread(
                    self.ctx._finish_call, self.kind, self.key, self.slot.entry, self.slot.result
                )
        finally:
            self.ctx._busy = False


def _by_value(fn: Any) -> None:
    """A function from an agent file (``tasks.agent`` imports it under a name no other process
    knows) is sent to the tool process by value, not by a reference it could not import."""
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    if module is not None and module.__name__.startswith(AGENT_FILE_MODULE):
        from ray import cloudpickle

        cloudpickle.register_pickle_by_value(module)


def _in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
    """``fn`` on a daemon thread of its own, awaitable. Not the loop's default executor: a call
    that never returns (a hung tool) must not keep ``asyncio.run`` from ending."""
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def target() -> None:
        if not done.set_running_or_notify_cancel():
            return
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as e:
            done.set_exception(e)

    threading.Thread(target=target, daemon=True, name="agent-call").start()
    return asyncio.wrap_future(done)


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


async def _bounded(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float) -> Any:
    """``fn(*args, **kwargs)`` within ``timeout`` seconds: awaited if async, else on a thread
    (a sync function that never returns leaves its thread behind: ``isolate=True`` kills it)."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an async callable object
    ):
        return await asyncio.wait_for(fn(*args, **kwargs), timeout)
    value = await asyncio.wait_for(_in_thread(fn, *args, **kwargs), timeout)
    if inspect.isawaitable(value):
        value = await asyncio.wait_for(value, timeout)
    return value


class _CallFailed(Exception):
    """Calling the agent function itself failed (``fn(ctx, prompt)`` raised ``TypeError``
    before its body ran): it cannot be called so on any input."""


class AgentRun:
    """One sample of an agent task, played (or replayed) by its agent function."""

    def __init__(
        self,
        engine: Engine,
        chat: Chat,
        spec: AgentSpec,
        prompt: dict[str, Any],
        tools: ToolRunner,
        limits: Limits,
        *,
        endpoint_host: str = "127.0.0.1",
        on_divergence: Callable[[str, int], None] | None = None,
        episode_id: int | None = None,
        sample_index: int = 0,
    ) -> None:
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
        from workers.agents.endpoint import shared_endpoint

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
    ) -> LoopOutcome:
        try:
            fn = load_agent(self.spec.agent)
        except AgentSpecError as e:  # it does not import here (its file or a module it needs)
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
        t.finished, t.stop_reason = True, stop
        calls = {"replayed": ctx.stats.replayed, "live": ctx.stats.live}
        t.state = {**t.state, "calls": calls, **({"info": info} if info else {})}
        return LoopOutcome(t, reward, len(t.turn_offsets))

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
            f"the agent {self.spec.agent} returned {type(result).__name__}, not an Outcome (or "
            "a number)",
            location=code_location(fn),
            kind="returned",
            head=f"the agent returned {type(result).__name__}",
            # a value of the wrong type is a programming error; None may be a branch that
            # forgot its return, taken on some inputs only
            input_independent=result is not None,
        )

    def _call(self, fn: Callable[..., Any], ctx: AgentContext) -> Any:
        """``await fn(ctx, prompt)`` on an event loop of its own thread, within the task's
        ``episode_timeout_s``: past it the function is cancelled (``UserCodeError``, where it
        was waiting); a function that cannot be cancelled (its thread blocked in synchronous
        code) is abandoned ``CANCEL_GRACE_S`` later, its calls through ``ctx`` refused."""
        from workers.agents.endpoint import registered

        timeout = float(getattr(self.spec, "episode_timeout_s", DEFAULT_EPISODE_TIMEOUT_S))
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
