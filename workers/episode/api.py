"""The values an agent function sees and returns."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """A tool call the model wrote, read by the model's tool-call format."""

    id: str
    name: str
    arguments: Any  # a JSON object (dict) when the call is well formed

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


@dataclass(frozen=True)
class Reply:
    """One generated assistant turn.

    ``message`` is what to append to the conversation (``{"role": "assistant", ...}`` with the
    OpenAI-style ``tool_calls``); ``text`` the turn as generated (its end-of-turn token
    removed); ``answer`` the text of a final answer (None when the turn calls a tool or is
    malformed); ``error`` why a turn that tried to call a tool could not be read (None
    otherwise); ``finish_reason`` ``stop`` or ``length`` (cut off at the token budget);
    ``version`` the policy version that generated it."""

    message: dict[str, Any]
    text: str
    tool_calls: list[ToolCall]
    answer: str | None
    error: str | None
    finish_reason: str
    version: int
    num_tokens: int


@dataclass(frozen=True)
class Outcome:
    """What an agent function returns: the episode's reward, and optional JSON-ready ``info``
    stored with the sample."""

    reward: float
    info: dict[str, Any] = field(default_factory=dict)


class AgentUsageError(RuntimeError):
    """A call through ``ctx`` that cannot be served as asked (e.g. a trained conversation that
    is rewritten instead of extended); it fails the episode with its one-sentence message."""


class ContextLimit(AgentUsageError):
    """The trajectory reached a limit (``max_turns`` trained calls, ``rollout.max_tokens``):
    no further trained call is possible. Left uncaught, the episode ends with reward 0."""


class ReplayDivergence(Exception):
    """On replay the agent function asked for a different call than the one recorded (its code
    is not deterministic given the recorded results). The episode's sample is restarted from
    scratch; the message says which call differed."""
