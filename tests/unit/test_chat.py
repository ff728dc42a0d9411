from __future__ import annotations

import pytest

from tasks.base import Tool
from workers.rollout.chat import (
    Answer,
    Malformed,
    ToolCall,
    observation_text,
    parse_turn,
    prompt_text,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '<tool>{"name": "calc", "arguments": {"expression": "6*7"}}</tool><|end|>',
            ToolCall("calc", {"expression": "6*7"}),
        ),
        ("think first <answer> 42 </answer><|end|>", Answer("42")),
        ('<answer>1</answer> then <tool>{"name": "x"}</tool>', Answer("1")),
        ('<tool>{"name": "x"}</tool> then <answer>1</answer>', ToolCall("x", {})),
        (
            '<tool>{"name": "calc", "arguments": [1]}</tool>',
            ToolCall("calc", [1]),
        ),  # the runner rejects it
        (
            "<tool>{name: calc}</tool>",
            Malformed(
                "the tool call is not valid JSON (Expecting property name enclosed in double quotes)"
            ),
        ),
        (
            '<tool>["calc"]</tool>',
            Malformed('the tool call needs {"name": ..., "arguments": {...}}'),
        ),
        ('<tool>{"name": "calc"', Malformed("the tool call is not closed with </tool>")),
        ("<answer>42", Malformed("the answer is not closed with </answer>")),
        ("<answer>  </answer>", Malformed("the answer is empty")),
        (
            "42",
            Malformed("no tool call and no answer; use <tool>...</tool> or <answer>...</answer>"),
        ),
    ],
)
def test_parse_turn(text: str, expected: object) -> None:
    assert parse_turn(text) == expected


def test_prompt_and_observation_text() -> None:
    tools = [
        Tool(
            "calc",
            "Evaluate.",
            {"type": "object", "properties": {"expression": {}}, "required": ["expression"]},
        )
    ]
    p = prompt_text(tools, "What is 6 times 7?")
    assert p.startswith("<|system|>\nTools:\n- calc(expression): Evaluate.\n")
    assert p.endswith("<|user|>\nWhat is 6 times 7?\n<|assistant|>\n")
    assert observation_text("42") == "\n<|tool|>\n42\n<|assistant|>\n"
