"""Tool-call formats: how a model writes a tool call and a final answer, as named parsers.

A format says what the system message tells the model about its tools (unless the chat
template renders the tools itself) and reads a generated assistant message (its end-of-turn
token removed) as a ``ParsedCall``, an ``Answer`` or a ``Malformed`` turn whose reason becomes the
observation. ``parse`` never raises.

- ``hermes``: the Hermes / Qwen / SmolLM style. A call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` inside the assistant message; the
  result comes back in a ``tool`` message; a message without a call is the final answer.
- ``json``: the whole message is one JSON object ``{"name": ..., "arguments": {...}}`` (a
  Markdown code fence around it is tolerated); anything else is the final answer.
- ``rollcall``: the tiny local model's format, ``<tool>{...}</tool>`` or ``<answer>...</answer>``
  (it answers only inside the answer tag).

Which text of an answer counts is the task's business (``read_answer`` of the plugin): the
format hands over the answer text as written.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from rollcall.tasks.base import Tool

MAX_ANSWER_CHARS = 500


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: Any


@dataclass(frozen=True)
class Answer:
    text: str


@dataclass(frozen=True)
class Malformed:
    reason: str


Action = ParsedCall | Answer | Malformed


class ToolFormat(Protocol):
    name: ClassVar[str]

    def system_text(self, tools: list[Tool], template_renders_tools: bool) -> str:
        """The system message: how to call the tools (and which, unless the template lists
        them) and how to answer."""
        ...

    def parse(self, text: str) -> Action: ...


def _call_from_json(raw: str) -> ParsedCall | Malformed:
    try:
        call = json.loads(raw)
    except json.JSONDecodeError as e:
        return Malformed(f"the tool call is not valid JSON ({e.msg})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return Malformed('the tool call needs {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return Malformed("the tool call's arguments are a string that is not JSON")
    return ParsedCall(call["name"], arguments)


def _answer(text: str) -> Answer | Malformed:
    value = text.strip()
    if not value:
        return Malformed("the reply is empty; call a tool or give the final answer")
    return Answer(value[:MAX_ANSWER_CHARS])


def _signature(tool: Tool) -> str:
    props = tool.parameters.get("properties", {})
    args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in props.items())
    return f"- {tool.name}({args}): {tool.description}"


def _example(tool: Tool) -> str:
    """A call of ``tool`` with placeholder arguments, as JSON."""
    props = tool.parameters.get("properties", {})
    return json.dumps({"name": tool.name, "arguments": {k: "..." for k in props}})


class HermesFormat:
    """The system text lists the tools (one line each: small models follow a short list better
    than the JSON schemas) and shows the call syntax with the first tool."""

    name: ClassVar[str] = "hermes"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def system_text(self, tools: list[Tool], template_renders_tools: bool) -> str:
        answer = "When you know the final answer, reply with the answer alone, without a tool call."
        if not tools:
            return answer
        how = (
            f"To use a tool, reply with only\n<tool_call>\n{_example(tools[0])}\n</tool_call>\n"
            "The result comes back in the next message. "
        )
        if template_renders_tools:
            return how + answer
        listing = "\n".join(_signature(t) for t in tools)
        return f"You have these tools:\n{listing}\n{how}{answer}"

    def parse(self, text: str) -> Action:
        call = self._CALL.search(text)
        if call:
            return _call_from_json(call.group(1).strip())
        if "<tool_call>" in text:
            return Malformed("the tool call is not closed with </tool_call>")
        return _answer(text)


class JsonFormat:
    name: ClassVar[str] = "json"
    _FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)

    def system_text(self, tools: list[Tool], template_renders_tools: bool) -> str:
        answer = "When you know the final answer, reply with the answer alone, not JSON."
        if not tools:
            return answer
        how = (
            'To call a tool, reply with only a JSON object: {"name": "<tool name>", '
            '"arguments": {<arguments>}}. The result comes back in the next message. '
        )
        if template_renders_tools:
            return how + answer
        listing = "\n".join(_signature(t) for t in tools)
        return f"You have these tools:\n{listing}\n{how}{answer}"

    def parse(self, text: str) -> Action:
        body = text.strip()
        fenced = self._FENCE.match(body)
        if fenced:
            body = fenced.group(1)
        if body.startswith("{"):
            return _call_from_json(body)
        return _answer(text)


class RollcallFormat:
    """The tiny local model's format (the text it is warm-started on)."""

    name: ClassVar[str] = "rollcall"
    _TOOL = re.compile(r"<tool>(.*?)</tool>", re.S)
    _ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)

    def system_text(self, tools: list[Tool], template_renders_tools: bool) -> str:
        if not tools:
            return "Answer with <answer>...</answer>."
        lines = ["Tools:"]
        for t in tools:
            args = ", ".join(t.parameters.get("properties", {}))
            lines.append(f"- {t.name}({args}): {t.description}")
        lines.append(
            'Call a tool with <tool>{"name": NAME, "arguments": {...}}</tool>. '
            "Give the final answer with <answer>...</answer>."
        )
        return "\n".join(lines)

    def parse(self, text: str) -> Action:
        tool = self._TOOL.search(text)
        answer = self._ANSWER.search(text)
        if answer and (not tool or answer.start() < tool.start()):
            value = answer.group(1).strip()
            if not value:
                return Malformed("the answer is empty")
            return Answer(value[:MAX_ANSWER_CHARS])
        if tool:
            return _call_from_json(tool.group(1))
        if "<tool>" in text:
            return Malformed("the tool call is not closed with </tool>")
        if "<answer>" in text:
            return Malformed("the answer is not closed with </answer>")
        return Malformed("no tool call and no answer; use <tool>...</tool> or <answer>...</answer>")


FORMATS: dict[str, ToolFormat] = {
    f.name: f for f in (HermesFormat(), JsonFormat(), RollcallFormat())
}

# The default format per model family (``model_type`` in the model's config.json): the families
# whose chat templates and instruct tuning use Hermes-style <tool_call> tags. Others: ``json``.
HERMES_FAMILIES = frozenset(
    {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "llama", "mistral", "smollm3", "olmo2"}
)


def get_format(name: str) -> ToolFormat:
    try:
        return FORMATS[name]
    except KeyError:
        known = ", ".join(sorted(FORMATS))
        raise ValueError(f"unknown tool-call format {name!r}; known formats: {known}") from None


def default_format(model_type: str | None, *, rollcall_markers: bool) -> str:
    """``rollcall`` for a tokenizer with the tiny model's chat markers, else by family."""
    if rollcall_markers:
        return "rollcall"
    return "hermes" if model_type in HERMES_FAMILIES else "json"
