from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollcall.tasks.base import Tool
from rollcall.workers.episode.chat import (
    ROLLCALL_TEMPLATE,
    Answer,
    Chat,
    ChatTemplateError,
    Malformed,
    ParsedCall,
    observation_text,
    parse_turn,
    prompt_text,
)
from rollcall.workers.episode.toolcalls import get_format


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '<tool>{"name": "calc", "arguments": {"expression": "6*7"}}</tool><|end|>',
            ParsedCall("calc", {"expression": "6*7"}),
        ),
        ("think first <answer> 42 </answer><|end|>", Answer("42")),
        ('<answer>1</answer> then <tool>{"name": "x"}</tool>', Answer("1")),
        ('<tool>{"name": "x"}</tool> then <answer>1</answer>', ParsedCall("x", {})),
        (
            '<tool>{"name": "calc", "arguments": [1]}</tool>',
            ParsedCall("calc", [1]),
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


CALC = Tool(
    "calc",
    "Evaluate.",
    {"type": "object", "properties": {"expression": {"type": "string"}}},
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '<tool_call>\n{"name": "calc", "arguments": {"expression": "6*7"}}\n</tool_call>',
            ParsedCall("calc", {"expression": "6*7"}),
        ),
        (
            'Let me compute. <tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1\\"}"}'
            "</tool_call>",
            ParsedCall("calc", {"expression": "1"}),
        ),  # arguments written as a JSON string
        ("The answer is 42.", Answer("The answer is 42.")),
        ("  ", Malformed("the reply is empty; call a tool or give the final answer")),
        (
            '<tool_call>{"name": "calc", "arguments": {}',
            Malformed("the tool call is not closed with </tool_call>"),
        ),
        (
            "<tool_call>{calc}</tool_call>",
            Malformed(
                "the tool call is not valid JSON (Expecting property name enclosed in double quotes)"
            ),
        ),
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            Malformed('the tool call needs {"name": ..., "arguments": {...}}'),
        ),
    ],
)
def test_hermes_format(text: str, expected: object) -> None:
    assert get_format("hermes").parse(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '{"name": "calc", "arguments": {"expression": "2"}}',
            ParsedCall("calc", {"expression": "2"}),
        ),
        ('```json\n{"name": "calc", "arguments": {}}\n```', ParsedCall("calc", {})),
        ("42", Answer("42")),
        ('{"name": 3}', Malformed('the tool call needs {"name": ..., "arguments": {...}}')),
    ],
)
def test_json_format(text: str, expected: object) -> None:
    assert get_format("json").parse(text) == expected


def test_system_text_names_the_tools_and_the_call_syntax() -> None:
    text = get_format("hermes").system_text([CALC], False)
    assert "- calc(expression: string): Evaluate." in text
    assert '<tool_call>\n{"name": "calc", "arguments": {"expression": "..."}}\n</tool_call>' in text
    # a template that renders the tools itself gets the syntax only
    assert "- calc" not in get_format("hermes").system_text([CALC], True)


def tiny_tokenizer(tiny_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


def observation_ids(chat: Chat, observation: str, *, ended: bool) -> list[int]:
    """The segment after a generated turn of a plugin's conversation (question "q")."""
    before = [*chat.head([CALC], "q"), {"role": "assistant", "content": "..."}]
    new = [{"role": "tool", "content": observation}]
    return chat.extension_ids(before, new, [CALC], ended=ended)


def test_the_tiny_model_renders_its_format_through_its_chat_template(tiny_dir: Path) -> None:
    tok = tiny_tokenizer(tiny_dir)
    assert tok.chat_template == ROLLCALL_TEMPLATE  # saved by the builder
    chat = Chat(tok)  # prefix stability is checked here
    assert chat.format.name == "rollcall"
    ids = chat.messages_ids(chat.head([CALC], "What is 6 times 7?"), [CALC])
    assert ids == tok.encode(prompt_text([CALC], "What is 6 times 7?"), add_special_tokens=False)
    assert tok.decode(observation_ids(chat, "42", ended=True)) == observation_text("42")
    # a turn cut off before <|end|>: the observation closes the assistant message first
    cut = tok.decode(observation_ids(chat, "42", ended=False))
    assert cut == "<|end|>" + observation_text("42")
    gen = tok.encode("<answer>42</answer><|end|>", add_special_tokens=False)
    assert chat.parse(gen) == Answer("42")


def test_a_tokenizer_with_markers_and_no_template_uses_the_rollcall_template(
    tiny_dir: Path,
) -> None:
    tok = tiny_tokenizer(tiny_dir)
    tok.chat_template = None  # a tiny model built before templates were saved
    assert Chat(tok).template == ROLLCALL_TEMPLATE


# A template that rewrites earlier assistant turns (as reasoning templates drop earlier
# thoughts): rendering one more message changes the text before it.
REWRITES_EARLIER_TURNS = ROLLCALL_TEMPLATE.replace(
    "message['content'] }}",
    "(message['content'] if message['role'] != 'assistant' or loop.last else '...') }}",
)
# A template that ends an assistant message with a token generation does not stop at.
WRONG_END = ROLLCALL_TEMPLATE.replace("{{ '<|end|>' }}", "{{ '.' }}")
# A template whose generation prompt differs from what precedes an assistant message.
WRONG_HEADER = ROLLCALL_TEMPLATE.replace("{{ '<|assistant|>\n' }}", "{{ '<|assistant|>' }}")


@pytest.mark.parametrize(
    ("template", "words"),
    [
        (REWRITES_EARLIER_TURNS, "not prefix-stable"),
        (WRONG_END, "does not end an assistant message"),
        (WRONG_HEADER, "generation prompt is not what precedes"),
    ],
)
def test_a_template_unfit_for_token_in_token_out_is_refused(
    tiny_dir: Path, template: str, words: str
) -> None:
    with pytest.raises(ChatTemplateError, match=words):
        Chat(tiny_tokenizer(tiny_dir), template=template)


def test_smollm2_renders_with_its_own_template_and_hermes_calls(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    chat = Chat(tok)  # prefix stability is checked here
    assert chat.format.name == "hermes"  # the default of its family (llama)
    head = chat.head([CALC], "What is 6 times 7?")
    ids = chat.messages_ids(head, [CALC])
    assert tok.decode(ids) == tok.apply_chat_template(
        head, tokenize=False, add_generation_prompt=True
    )
    assert str(tok.decode(ids)).startswith("<|im_start|>system\nYou have these tools:\n- calc(")
    obs = tok.decode(observation_ids(chat, "42", ended=True))
    assert obs == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


TEXTS = [
    "",
    "<|end|>\n<|tool|>42<|end|>\n<|assistant|>\n",
    '<tool>{"name": "calc", "arguments": {"expression": "6*7"}}</tool><|end|>',
    "\n<|im_start|>tool\nhigher<|im_end|>\n<|im_start|>assistant\n",
    "  spaces  and\ttabs\n\n, unicode é 日本 😀 and a lone <|end",
]


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_the_backend_shortcut_encodes_and_decodes_as_transformers_does(
    model: str, request: pytest.FixtureRequest
) -> None:
    """``Chat`` calls a fast tokenizer's Rust backend directly (``plain_backend``): the same
    ids and text as transformers' ``encode``/``decode``, and transformers' own path when the
    backend's state is not what transformers' encode would set (truncation left on by
    another caller: the backend alone would cut the text)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(request.getfixturevalue(f"{model}_dir"))
    chat = Chat(tok)
    assert chat._backend is not None  # the shortcut is taken for these tokenizers
    for text in TEXTS:
        ids = chat._encode(text)
        assert ids == tok.encode(text, add_special_tokens=False)
        body = ids[:-1] if ids and ids[-1] == chat.eos_id else ids  # a turn's end is not text
        assert chat.turn_text(ids) == tok.decode(body, skip_special_tokens=False)
    long = TEXTS[2]
    backend: Any = tok._tokenizer
    backend.enable_truncation(max_length=2)
    try:
        assert len(backend.encode(long, add_special_tokens=False).ids) == 2
        assert chat._encode(long) == AutoTokenizer.from_pretrained(tok.name_or_path).encode(
            long, add_special_tokens=False
        )
    finally:
        backend.no_truncation()


def test_extending_a_conversation_renders_its_head_once(tiny_dir: Path) -> None:
    """``extension_base`` is what ``extension_ids`` renders after: given it, the segment is the
    same, and only the new messages are rendered again."""
    chat = Chat(tiny_tokenizer(tiny_dir))
    before = [*chat.head([CALC], "q"), {"role": "assistant", "content": "..."}]
    new = [{"role": "tool", "content": "42"}]
    base = chat.extension_base(before, [CALC])
    rendered: list[int] = []
    real = chat._render

    def counting(messages: list[dict[str, Any]], *a: Any, **k: Any) -> str:
        rendered.append(len(messages))
        return real(messages, *a, **k)

    chat._render = counting  # type: ignore[method-assign]
    with_base = chat.extension_ids(before, new, [CALC], ended=True, base=base)
    assert rendered == [4]  # head (2) + probe + the tool message: the head's render is reused
    assert with_base == chat.extension_ids(before, new, [CALC], ended=True)
