"""What an agent passes to ``ctx.chat`` and gets back, made uniform: messages as role and text,
tools as ``Tool`` values, the messages as rendered with the tools' instructions, a generated
turn as a ``Reply``, a tool's result as text."""

from __future__ import annotations

import json
from typing import Any

from rollcall.tasks.base import Tool
from rollcall.workers.episode.api import AgentUsageError, Reply, ToolCall
from rollcall.workers.episode.chat import Chat
from rollcall.workers.episode.toolcalls import Answer, Malformed, ParsedCall


def content(value: Any) -> str:
    """A message's content as text (OpenAI content parts joined)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in value)
    return str(value)


def as_message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise AgentUsageError(f"{where}: every message must be a dict with a 'role'")
    return {"role": m["role"], "content": content(m.get("content"))}


def tools_of(tools: Any) -> list[Tool]:
    """OpenAI-style tool dicts (``{"type": "function", "function": {...}}`` or the function
    dict itself) or ``rollcall.tasks.base.Tool`` values."""
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


def as_text(value: Any) -> str:
    """A tool's result as its observation's text."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def with_tool_text(
    chat: Chat, msgs: list[dict[str, Any]], tools: list[Tool]
) -> list[dict[str, Any]]:
    """The messages as rendered: how to call the tools (the tool-call format's system text,
    the same the built-in tasks use) in the system message, added when there are tools."""
    if not tools:
        return list(msgs)
    text = chat.format.system_text(tools, chat.renders_tools)
    if msgs and msgs[0]["role"] == "system":
        first = {"role": "system", "content": f"{msgs[0]['content']}\n\n{text}"}
        return [first, *msgs[1:]]
    return [{"role": "system", "content": text}, *msgs]


def reply_of(chat: Chat, calls_so_far: int, ids: list[int], finish: str, version: int) -> Reply:
    """A generated turn as the agent sees it (its tool call named ``call_<calls_so_far>``)."""
    text = chat.turn_text(ids)
    action = chat.format.parse(text) if finish == "stop" else Malformed("the turn was cut off")
    calls: list[ToolCall] = []
    answer = error = None
    if isinstance(action, ParsedCall):
        calls = [ToolCall(f"call_{calls_so_far}", action.name, action.arguments)]
    elif isinstance(action, Answer):
        answer = action.text
    else:
        error = action.reason
    message: dict[str, Any] = {"role": "assistant", "content": answer if answer else text}
    if calls:
        message["content"] = None
        message["tool_calls"] = [c.to_openai() for c in calls]
    return Reply(message, text, calls, answer, error, finish, version, len(ids))
