"""The engine protocol: generate tokens with their behaviour log-probs, load the weights of a
policy version, report health and progress.

An engine that batches concurrent requests itself (vLLM's continuous batching) sets the class
attribute ``batches_itself = True``; a rollout node then sends each agent loop's request to it
directly instead of gathering them into one call (``BatchingEngine``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class EngineFailure(RuntimeError):
    """The engine itself failed: its process died, it did not answer within its timeout, or it
    cannot serve (weights not loaded). Not the episode's fault: a rollout node that sees it
    gives its episodes back without counting an attempt, and an engine that is dead
    (``fatal``) ends the node, which the supervisor restarts."""

    def __init__(self, message: str, *, fatal: bool = True) -> None:
        super().__init__(message)
        self.fatal = fatal


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]  # the whole context so far, exactly as the trajectory holds it
    max_new_tokens: int
    temperature: float = 1.0
    # Seeded sampling: the token at sequence position p is drawn with a random number that
    # depends on (seed, p) only, not on the batch or on earlier requests, so the same context
    # and weights give the same tokens (evaluation uses it; rollout leaves it None).
    seed: int | None = None


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]  # generated tokens, the stop token included when one was produced
    logprobs: list[float]  # log-prob of each generated token under the sampling distribution
    finish_reason: str  # "stop" (stop token) or "length"
    version: int  # the policy version that generated them
    cached_tokens: int = 0  # context tokens whose KV came from a cache (not prefilled again)


@dataclass(frozen=True)
class EngineHealth:
    version: int
    tokens_generated: int
    requests: int


class Engine(Protocol):
    tokenizer: Any  # the model's tokenizer: the agent loop encodes prompt and tool segments

    @property
    def version(self) -> int: ...

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]: ...

    def load_weights(self, version: int, location: str) -> None: ...

    def health(self) -> EngineHealth: ...


def seeded(seed: int, position: int) -> int:
    """A 63-bit seed for sampling at ``position`` of a sequence seeded with ``seed``."""
    import hashlib

    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
