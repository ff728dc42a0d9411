"""Limits on untrusted inputs (``rollout.input_limits``, docs/security.md): how big each one is,
and the one sentence that says it is too big.

An input is measured as the bytes of its UTF-8 text (an observation) or of its compact JSON (a
prompt row, tool-call arguments, a ``ctx.step`` result). Standard library only: the control
plane (the seeder) and the rollout nodes both use it.
"""

from __future__ import annotations

import json
from typing import Any

# A prompt row over ``rollout.input_limits.prompt_bytes`` is seeded as this marker instead of
# the row: the episode exists (its index is not skipped), and the node that claims it fails it
# as its input's fault with the sentence below, without the row ever in its memory.
OVERSIZE_KEY = "rollcall_oversize_prompt"


def json_bytes(value: Any) -> int:
    """The size of ``value`` as compact JSON, in bytes (``str()`` for what JSON cannot say)."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)
    return len(text.encode("utf-8", errors="replace"))


def text_bytes(text: str) -> int:
    return len(text.encode("utf-8", errors="replace"))


def too_big(what: str, size: int, key: str, limit: int) -> str:
    """``what`` is ``size`` bytes, over ``rollout.input_limits.KEY`` (``limit``)."""
    return f"{what} is {size:,} bytes, over rollout.input_limits.{key} ({limit:,})"


def bounded_prompt(prompt: Any, limit: int | None) -> Any:
    """The prompt row as seeded: itself, or the oversize marker when it is over ``limit``."""
    if limit is None:
        return prompt
    size = json_bytes(prompt)
    if size <= limit:
        return prompt
    return {OVERSIZE_KEY: {"bytes": size, "limit": limit}}


def prompt_problem(prompt: Any, limit: int | None) -> str | None:
    """Why a claimed prompt row cannot be played (over the limit), or None."""
    if isinstance(prompt, dict) and isinstance(prompt.get(OVERSIZE_KEY), dict):
        marker = prompt[OVERSIZE_KEY]
        return too_big(
            "the prompt row", int(marker.get("bytes", 0)), "prompt_bytes", int(marker["limit"])
        )
    if limit is not None and (size := json_bytes(prompt)) > limit:
        return too_big("the prompt row", size, "prompt_bytes", limit)
    return None


def arguments_problem(name: str, arguments: Any, limit: int) -> str | None:
    """Why a model's call to the tool ``name`` is refused (its ``arguments`` over ``limit``
    bytes; the tool is not called), or None."""
    if (size := json_bytes(arguments)) <= limit:
        return None
    return too_big(
        f"the arguments of the call to {name[:64]!r}", size, "tool_arguments_bytes", limit
    )
