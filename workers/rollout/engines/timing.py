"""``timing_model``: a benchmark engine that models an inference engine's timing instead of
running a model (``ops/bench/pipeline.py``). Not for training: it generates no language.

It stands where a continuous-batching engine with a prefix cache (vLLM) stands, and behaves
like one in what the orchestrator can observe:

- **Tokens.** Every turn is a well-formed tool call of the ``longtail`` task's protocol,
  ``<tool>{"name": TOOL, "arguments": {"draw": D, "pad": "000..."}}</tool><|end|>``, built from
  the model's tokenizer so that it is exactly ``n`` tokens long, ``n`` drawn log-uniformly from
  ``turn_tokens_min..turn_tokens_max`` (cut at the request's budget, then ``finish_reason`` is
  ``length``). ``D`` is a random draw that the task uses to sample its side of the trajectory
  (turns, tool latency, observation length), as sampled tokens would steer a real episode.
  Every token's behaviour log-prob is the fixed ``logprob``.
- **Time.** A request sleeps ``prefill_s_per_token x (context tokens not in the prefix cache)
  + n x decode_s_per_token x (1 + decode_batch_slope x (requests in flight - 1))`` simulated
  seconds, each ``time_scale`` real seconds. Requests from concurrent agent loops run
  concurrently (``batches_itself``: the node sends each loop's request here directly).
- **Prefix cache.** The engine remembers (length, hash) of every context it served and every
  context-plus-generation it produced (LRU, ``prefix_cache_entries``); a request's cached
  prefix is its whole context (another sample of the same prompt) or the context up to its
  last end-of-turn token (the next turn of the same trajectory). A weight load clears it.
- **Weights.** ``load_weights`` reads the published file (real IO) and sleeps ``load_s``.

The module imports no torch and loads no model: only ``tokenizer.json`` (``tokenizers``), so a
rollout node running it costs a Ray actor and little memory.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from rollcall.orchestrator.config import TimingEngineConfig
from rollcall.workers.episode.engine import EngineHealth, Generation, GenerationRequest

WEIGHTS_FILE = "model.safetensors"
END_SCAN_TOKENS = 4096  # how far back from a context's end to look for the last end of turn


class FileTokenizer:
    """The model's ``tokenizer.json`` through ``tokenizers`` alone (no transformers, no torch),
    with the few methods the agent loop uses: ``encode``, ``decode`` and ``eos_token_id``."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        d = Path(model_dir)
        self._tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        config_path = d / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.eos_token = _token_text(config.get("eos_token")) or "<|end|>"
        eos = self._tok.token_to_id(self.eos_token)
        if eos is None:
            raise ValueError(f"{d}: the tokenizer has no end-of-turn token {self.eos_token!r}")
        self.eos_token_id = int(eos)
        pad = self._tok.token_to_id(_token_text(config.get("pad_token")) or "")
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_id
        self.name_or_path = str(d)
        template = d / "chat_template.jinja"
        self.chat_template: str | None = (
            template.read_text() if template.exists() else config.get("chat_template")
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<|end|>", ...} in some tokenizer configs
        value = value.get("content")
    return value if isinstance(value, str) else None


def log_uniform_int(rng: random.Random, low: int, high: int) -> int:
    """An integer in [low, high], log-uniformly distributed (many short, a long tail)."""
    if high <= low:
        return low
    return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))


class TimingEngine:
    batches_itself = True  # concurrent requests run concurrently, as in continuous batching

    def __init__(
        self,
        config: TimingEngineConfig,
        model_dir: str | Path,
        *,
        seed: int = 0,
        version: int = 0,
        sleep: Any = time.sleep,
    ) -> None:
        self.config = config
        self.tokenizer = FileTokenizer(model_dir)
        self._sleep = sleep
        self._rng = random.Random(f"timing-engine:{seed}")
        self._version = version
        self._lock = threading.Lock()
        self._in_flight = 0
        self.peak_in_flight = 0  # most requests generating at once
        self._tokens = 0
        self._requests = 0
        self.reused_tokens = 0  # context tokens served from the prefix cache
        self.prefilled_tokens = 0  # context tokens the model would have computed
        self.modelled_s = 0.0  # simulated seconds slept by generate
        self._cache: OrderedDict[tuple[int, int], None] = OrderedDict()
        enc = self.tokenizer.encode
        self._head = enc('<tool>{"name": ' + json.dumps(config.tool) + ', "arguments": {"draw": ')
        self._mid = enc(', "pad": "')
        self._tail = [*enc('"}}</tool>'), self.tokenizer.eos_token_id]
        pad = enc("0")
        if len(pad) != 1:
            raise ValueError("the tokenizer must encode the digit 0 as one token")
        self._pad = pad[0]

    @property
    def version(self) -> int:
        return self._version

    # -- the model of one turn ------------------------------------------------------------------

    def turn_tokens(self, draw: int, length: int) -> list[int]:
        """A tool call with argument ``draw``, exactly ``length`` tokens long (or the shortest
        such call, when ``length`` is shorter)."""
        body = [*self._head, *self.tokenizer.encode(str(draw)), *self._mid]
        pad = max(0, length - len(body) - len(self._tail))
        return [*body, *([self._pad] * pad), *self._tail]

    def modelled_seconds(self, uncached: int, generated: int, in_flight: int) -> float:
        c = self.config
        step = c.decode_s_per_token * (1.0 + c.decode_batch_slope * max(0, in_flight - 1))
        return uncached * c.prefill_s_per_token + generated * step

    # -- the prefix cache -------------------------------------------------------------------------

    def _cached_prefix(self, ids: list[int]) -> int:
        if self.config.prefix_cache_entries == 0 or not ids:
            return 0
        candidates = [len(ids)]
        eos = self.tokenizer.eos_token_id
        for i in range(len(ids) - 1, max(-1, len(ids) - 1 - END_SCAN_TOKENS), -1):
            if ids[i] == eos:
                candidates.append(i + 1)
                break
        with self._lock:
            for n in candidates:
                key = (n, hash(tuple(ids[:n])))
                if key in self._cache:
                    self._cache.move_to_end(key)
                    return n
        return 0

    def _remember(self, ids: list[int]) -> None:
        if self.config.prefix_cache_entries == 0:
            return
        key = (len(ids), hash(tuple(ids)))
        with self._lock:
            self._cache[key] = None
            self._cache.move_to_end(key)
            while len(self._cache) > self.config.prefix_cache_entries:
                self._cache.popitem(last=False)

    # -- the engine protocol ----------------------------------------------------------------------

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        c = self.config
        with self._lock:
            self._in_flight += len(requests)
            in_flight = self._in_flight
            self.peak_in_flight = max(self.peak_in_flight, in_flight)
            draws = [
                (
                    self._rng.randrange(10**6),
                    log_uniform_int(self._rng, c.turn_tokens_min, c.turn_tokens_max),
                )
                for _ in requests
            ]
        try:
            out: list[Generation] = []
            uncached_total = 0
            longest = 0
            for r, (draw, length) in zip(requests, draws, strict=True):
                cached = self._cached_prefix(r.prompt_ids)
                uncached_total += len(r.prompt_ids) - cached
                full = self.turn_tokens(draw, length)
                ids = full[: max(0, r.max_new_tokens)]
                reason = "stop" if len(ids) == len(full) else "length"
                longest = max(longest, len(ids))
                self._remember(r.prompt_ids)
                self._remember([*r.prompt_ids, *ids])
                with self._lock:
                    self.reused_tokens += cached
                    self.prefilled_tokens += len(r.prompt_ids) - cached
                out.append(Generation(ids, [c.logprob] * len(ids), reason, self._version, cached))
            # One batch: its prefill, then decode steps for its longest output.
            seconds = self.modelled_seconds(uncached_total, longest, in_flight)
            self._sleep(seconds * c.time_scale)
            with self._lock:
                self.modelled_s += seconds
                self._tokens += sum(len(g.token_ids) for g in out)
                self._requests += len(requests)
            return out
        finally:
            with self._lock:
                self._in_flight -= len(requests)

    def load_weights(self, version: int, location: str) -> None:
        data = (Path(location) / WEIGHTS_FILE).read_bytes()  # OSError when pruned meanwhile
        self._sleep(self.config.load_s * self.config.time_scale)
        with self._lock:
            self._version = version
            self._cache.clear()  # computed with the old weights
        del data

    def health(self) -> EngineHealth:
        return EngineHealth(self._version, self._tokens, self._requests)
