"""A built-in task plugin as an agent function (``play_plugin``), played by the one episode
runtime (``rollcall.workers.episode.runtime``) with its record, replay and checkpoints.

A turn: the model generates (a trained ``chat`` call, checkpointed), then the tool call it
makes is applied to the plugin's environment (``call_tool`` in the node's tool process,
recorded with the state it leaves and checkpointed with the next turn: it is deterministic, so
one lost with its process is made again on replay), or its final answer is read by the task
(``read_answer``) before the reward sees it. A turn that is cut off, malformed, an unknown tool,
bad or oversized arguments, a tool error or timeout become an error observation for the model;
the limits (turns, tokens per turn, tokens per trajectory) end the trajectory without an answer
after what the model was last told; the environment may end it (a game won).

The conversation is the plugin's (the format's system text with its tools, the task's
instructions, then tool messages); each observation is rendered as one tool message after the
turn, so a turn costs what rendering one message costs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from rollcall.orchestrator.inputs import arguments_problem
from rollcall.tasks.base import TaskPlugin, TaskSpec
from rollcall.workers.episode.api import ContextLimit, Outcome, ToolCall
from rollcall.workers.episode.context import AgentContext
from rollcall.workers.episode.journal import fingerprint
from rollcall.workers.episode.usercode import check_json, check_reward, user_call

CUT_OFF = "error: the turn was cut off; end each turn with a tool call or an answer"


def plugin_agent(
    plugin: TaskPlugin, spec: TaskSpec
) -> Callable[[AgentContext, dict[str, Any]], Awaitable[Outcome]]:
    """``plugin``'s episodes under ``spec`` as an agent function."""

    async def play_plugin(ctx: AgentContext, prompt: dict[str, Any]) -> Outcome:
        # the plugin's code is the task's (the user's): what it raises fails the episode as
        # its input's fault (UserCodeError), never the node
        tools = user_call("the task's tools", plugin.tools, spec)
        instructions = user_call("the task's instructions", plugin.instructions, spec, prompt)
        state = user_call("the task's initial state", plugin.initial_state, spec, prompt)
        check_json(state, "the task's initial state", plugin.initial_state)
        ctx._as_rendered = True
        limits = ctx.limits
        messages = ctx._run.chat.head(tools, instructions)
        answer: str | None = None
        while True:
            try:  # on this thread: a plugin's episode has no timeout to be cancelled by
                reply = ctx.chat_sync(messages, tools)
            except ContextLimit:
                room = limits.max_tokens - len(ctx.trajectory.token_ids)
                stop = "turn limit" if min(limits.max_tokens_per_turn, room) > 0 else "token limit"
                break
            messages.append(reply.message)
            if reply.finish_reason != "stop":
                observation = CUT_OFF
            elif reply.answer is not None:
                answer, stop = _read(plugin, spec, reply.answer), "answer"
                break
            elif not reply.tool_calls:
                observation = f"error: {reply.error}"
            else:
                observation, state, done = _apply(ctx, plugin, spec, state, reply.tool_calls[0])
                if done:  # the environment ended the episode (e.g. the game was won)
                    stop = "environment"
                    break
            messages.append({"role": "tool", "content": observation})
        turns = len(ctx.trajectory.turn_offsets)
        reward = user_call("the task's reward", plugin.reward, spec, prompt, answer, state, turns)
        ctx.trajectory.answer = answer
        ctx._stop_reason, ctx._env_state = stop, state
        return Outcome(check_reward(reward, "the task's reward", plugin.reward))

    play_plugin.__qualname__ = f"play_plugin[{type(plugin).__name__}]"
    return play_plugin


def _apply(
    ctx: AgentContext, plugin: TaskPlugin, spec: TaskSpec, state: dict[str, Any], call: ToolCall
) -> tuple[str, dict[str, Any], bool]:
    """(observation, state after, the environment ended) of ``call`` on ``state``."""
    refused = arguments_problem(call.name, call.arguments, ctx.limits.tool_arguments_bytes)
    if refused is not None:  # the tool is not called
        return f"error: {refused}", state, False

    def live() -> dict[str, Any]:
        r = ctx._run.tools.call(
            plugin, spec, ctx.prompt, state, call.name, call.arguments,
            network=ctx.limits.network,
        )  # fmt: skip
        check_json(r.state, "the task's state after a tool call", plugin.call_tool)
        return {"c": r.observation, "s": r.state, "d": r.done}

    key = fingerprint("tool", call.name, call.arguments)
    r = ctx._recorded("tool", key, call.name, live, defer=True)
    return str(r["c"]), dict(r["s"]), bool(r["d"])


def _read(plugin: TaskPlugin, spec: TaskSpec, text: str) -> str | None:
    """The final answer as the task reads it (``read_answer``; plugins without one take the
    text as written)."""
    read = getattr(plugin, "read_answer", None)
    return text if read is None else user_call("the task's read_answer", read, spec, text)
