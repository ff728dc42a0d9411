"""The conversation format of rollcall's agent loop, and the parser of model turns.

A trajectory is built from text segments, each encoded once and appended (token-in/token-out):

    <|system|>\\n{tool list and rules}\\n<|user|>\\n{task}\\n<|assistant|>\\n   (prompt, mask 0)
    {generated turn, ending with <|end|>}                                    (mask 1)
    \\n<|tool|>\\n{observation}\\n<|assistant|>\\n                              (mask 0)
    {generated turn} ...

In a generated turn the model either calls a tool, ``<tool>{"name": "calc", "arguments":
{"expression": "6*7"}}</tool>``, or answers, ``<answer>42</answer>``. ``parse_turn`` never
raises: anything else is ``Malformed`` with a reason that becomes the observation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tasks.base import Tool

SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
TOOL = "<|tool|>"
END = "<|end|>"
SPECIAL_TOKENS = (SYSTEM, USER, ASSISTANT, TOOL, END)

_TOOL_RE = re.compile(r"<tool>(.*?)</tool>", re.S)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.S)
MAX_ANSWER_CHARS = 500


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Any


@dataclass(frozen=True)
class Answer:
    text: str


@dataclass(frozen=True)
class Malformed:
    reason: str


def system_text(tools: list[Tool]) -> str:
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


def prompt_text(tools: list[Tool], instructions: str) -> str:
    return f"{SYSTEM}\n{system_text(tools)}\n{USER}\n{instructions}\n{ASSISTANT}\n"


def observation_text(observation: str) -> str:
    return f"\n{TOOL}\n{observation}\n{ASSISTANT}\n"


def parse_turn(text: str) -> ToolCall | Answer | Malformed:
    text = text.replace(END, "")
    tool = _TOOL_RE.search(text)
    answer = _ANSWER_RE.search(text)
    if answer and (not tool or answer.start() < tool.start()):
        value = answer.group(1).strip()
        if not value:
            return Malformed("the answer is empty")
        return Answer(value[:MAX_ANSWER_CHARS])
    if tool:
        try:
            call = json.loads(tool.group(1))
        except json.JSONDecodeError as e:
            return Malformed(f"the tool call is not valid JSON ({e.msg})")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return Malformed('the tool call needs {"name": ..., "arguments": {...}}')
        return ToolCall(call["name"], call.get("arguments", {}))
    if "<tool>" in text:
        return Malformed("the tool call is not closed with </tool>")
    if "<answer>" in text:
        return Malformed("the answer is not closed with </answer>")
    return Malformed("no tool call and no answer; use <tool>...</tool> or <answer>...</answer>")
