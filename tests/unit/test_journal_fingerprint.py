"""``chat_fingerprint`` hashes the same text as ``fingerprint("chat", ...)``: a record written
before it (or by either) replays under the other, and a changed message changes the key."""

from __future__ import annotations

import random
from typing import Any

from rollcall.workers.episode.journal import chat_fingerprint, fingerprint

PIECES = [
    "",
    "a",
    ' "quoted" ',
    "back\\slash",
    "new\nline",
    "tab\t",
    "é日本😀",
    "\x00\x1f",
    "<|end|>",
]


def _message(rnd: random.Random) -> dict[str, str]:
    role = rnd.choice(["system", "user", "assistant", "tool"])
    return {"role": role, "content": "".join(rnd.choice(PIECES) for _ in range(rnd.randint(0, 6)))}


def test_it_equals_the_fingerprint_of_the_whole_call() -> None:
    rnd = random.Random(7)
    tools: list[Any] = [
        [],
        [{"name": "calc", "description": "d", "parameters": {"type": "object", "b": 1, "a": [2]}}],
    ]
    for _ in range(300):
        seen: dict[tuple[str, str], str] = {}
        conversation = [_message(rnd) for _ in range(rnd.randint(1, 4))]
        for _ in range(4):  # a conversation extended call after call, one cache
            train = rnd.choice([True, False, 1])
            max_tokens = rnd.choice([None, 5, 7.5])
            t = rnd.choice(tools)
            want = fingerprint("chat", train, conversation, t, max_tokens)
            assert chat_fingerprint(train, conversation, t, max_tokens, seen) == want
            conversation = [*conversation, _message(rnd), _message(rnd)]


def test_a_changed_message_changes_the_key() -> None:
    seen: dict[tuple[str, str], str] = {}
    one = [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]
    two = [{"role": "user", "content": "a"}, {"role": "tool", "content": "c"}]
    assert chat_fingerprint(True, one, [], None, seen) != chat_fingerprint(
        True, two, [], None, seen
    )
