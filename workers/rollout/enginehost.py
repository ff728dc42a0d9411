"""A rollout node's engine and its guard.

``EngineHost`` builds the node's engine (``make_engine``, then the fault-injection hook when
one is set) and holds what the node's parts use of it: the engine as built (``base``: its
health, version, probe, broadcast receive), the batcher that lets the agent loops share one
generate call, and the guarded engine (``engine``) the loops and weight loads call, with its
tokenizer and chat format.

``GuardedEngine`` is the engine guard: whatever the engine raises is the engine's failure, not
the episode's (never counted as an attempt).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rollcall.workers.episode.chat import Chat, chat_for
from rollcall.workers.episode.engine import (
    Engine,
    EngineFailure,
    EngineHealth,
    Generation,
    GenerationRequest,
)
from rollcall.workers.rollout.engines.batching import BatchingEngine
from rollcall.workers.rollout.engines.factory import make_engine

if TYPE_CHECKING:
    from rollcall.workers.rollout.node import NodeConfig


class GuardedEngine:
    """The engine as the agent loops see it: an exception raised inside the engine (not by the
    task's code) becomes ``EngineFailure`` (not fatal), so it is never counted as an attempt of
    the episode; a dead engine's fatal ``EngineFailure`` passes as it is."""

    def __init__(self, engine: Engine) -> None:
        self.inner = engine
        self.tokenizer = engine.tokenizer

    @property
    def version(self) -> int:
        return self.inner.version

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        try:
            return self.inner.generate(requests)
        except EngineFailure:
            raise
        except Exception as e:  # out of memory, a kernel error, a broken engine
            raise EngineFailure(f"the engine raised {type(e).__name__}: {e}", fatal=False) from e

    def load_weights(self, version: int, location: str) -> None:
        self.inner.load_weights(version, location)

    def health(self) -> EngineHealth:
        return self.inner.health()


class EngineHost:
    """The node's engine once ``start`` built it (its attributes are set there)."""

    base: Engine  # the engine as built (hooked): health, version, probe, failure, receive
    batcher: BatchingEngine | None  # the loops' shared generate call (None: the engine batches)
    engine: Engine  # the guarded engine: what the loops and the weight loads call
    tokenizer: Any
    chat: Chat

    def __init__(self, config: NodeConfig) -> None:
        self.config = config

    def built(self) -> Engine | None:
        """The engine as built, or None while it is being built."""
        return getattr(self, "base", None)

    def start(self) -> None:
        config = self.config
        engine = make_engine(
            config.engine,
            config.model_dir,
            seed=config.seed,
            threads=config.threads,
            lora_rank=config.lora_rank,
        )
        if config.engine_hook:  # fault injection (tests, drills): wraps the engine
            module, _, rest = config.engine_hook.partition(":")
            name, _, arg = rest.partition(":")
            hook = getattr(importlib.import_module(module), name)
            engine = hook(engine, arg) if arg else hook(engine)
        self.base = engine
        # The agent loops share one generate call (BatchingEngine), unless the engine batches
        # concurrent requests itself (vLLM): then each loop's request goes to it directly.
        self.batcher = None
        if not getattr(engine, "batches_itself", False):
            self.batcher = BatchingEngine(engine, max_batch=max(1, config.concurrency))
        # Whatever the engine raises is the engine's failure, not the episode's (not counted)
        self.engine = GuardedEngine(self.batcher or engine)
        self.tokenizer = engine.tokenizer
        self.chat = chat_for(self.tokenizer, config.tool_format, config.chat_template)
