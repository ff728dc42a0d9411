"""The ``hf`` engine: transformers on CPU or GPU, the default engine and the one tests use.

Concurrent requests (the agent loops of a node, gathered by ``BatchingEngine``) are generated
together by the engine's own sampling loop over the model's forward pass:

- **KV reuse, batched.** The engine keeps the KV cache of every sequence it generated
  (``KVStore``, bounded by ``kv_cache_tokens``). A request whose context shares a prefix with
  one of them (the next turn of the same trajectory shares all of it; another sample of the same
  prompt shares the prompt) starts from that cache and only prefills the rest. The rows of a
  batch are right-aligned: each row's cached tokens sit left of one common suffix window of
  width S (the longest uncached suffix), so the batch's prefill is B x S tokens instead of
  B x (longest context). A row whose uncached part is shorter than S feeds the last few cached
  tokens again (their cache is cropped), which keeps the layout rectangular. Positions come
  from each row's own token count, so left padding never shifts them.
- **Behaviour log-probs** are the log-softmax of the raw logits divided by the temperature,
  at the sampled token: with plain sampling (no top-k, top-p or other warpers, which this
  loop does not have) they are exactly the log-probs of the distribution each token was drawn
  from, and equal a teacher-forced forward pass.
- Loading new weights drops every cache (computed with the old weights).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

from rollcall.workers import lora
from rollcall.workers.episode.engine import (
    EngineHealth,
    Generation,
    GenerationRequest,
    seeded,
)
from rollcall.workers.rollout.engines.kvstore import KVEntry, KVStore
from rollcall.workers.weights import copy_into, load_into

DEFAULT_KV_CACHE_TOKENS = 65_536
Source = tuple[KVEntry | None, int]  # a row's cached prefix: the entry holding it, its length
# The fixed cost of one more forward pass, in tokens per row (``catch_up_width``).
CATCH_UP_SLACK = 32


def catch_up_width(uncached: list[int], slack: int) -> int:
    """The batch's suffix window when the rows with a longer uncached part are prefilled
    first, chosen to minimise tokens fed: with the rows' uncached lengths sorted
    u_1 <= ... <= u_B and a window of u_k, the batch feeds B x u_k and the catch-up pass
    (B - k) x (u_B - u_k), plus ``slack`` x B for the extra pass; u_B means no catch-up."""
    u = sorted(uncached)
    rows, longest = len(u), u[-1]
    best, best_cost = longest, rows * longest
    for k in range(1, rows):
        if u[k - 1] == longest:
            break
        cost = rows * u[k - 1] + (rows - k) * (longest - u[k - 1]) + slack * rows
        if cost < best_cost:
            best, best_cost = u[k - 1], cost
    return best


class HFEngine:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "cpu",
        version: int = 0,
        seed: int = 0,
        kv_reuse: bool = True,
        kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS,
        dtype: str = "auto",
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
        from transformers.cache_utils import DynamicLayer
        from transformers.utils import logging as hf_logging

        self._torch = torch
        self._DynamicCache = DynamicCache
        self.device = torch.device(device)
        hf_logging.disable_progress_bar()
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        # "auto": the dtype the folder's config names (a float32 tiny model, a bf16 SmolLM2)
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=dtype if dtype == "auto" else getattr(torch, dtype)
        )
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        self.eos_id = int(self.tokenizer.eos_token_id)
        self.pad_id = int(self.tokenizer.pad_token_id)
        self._version = version
        self._tokens = 0
        self._requests = 0
        self._lock = threading.Lock()
        # Reuse needs plain full-attention layers (a sliding-window layer drops old tokens).
        probe = DynamicCache(config=self.model.config)
        self._reusable = all(type(layer) is DynamicLayer for layer in probe.layers)
        self.kv_reuse = kv_reuse and self._reusable and kv_cache_tokens > 0
        self.kv = KVStore(kv_cache_tokens)
        self.cache_hits = 0  # requests that started from a cached prefix
        self.reused_tokens = 0  # context tokens not prefilled thanks to a cache
        self.prefilled_tokens = 0  # context tokens the forward pass computed
        self.catch_ups = 0  # rows prefilled on their own before their batch (``_catch_up``)
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)

    @property
    def version(self) -> int:
        return self._version

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        if not requests:
            return []
        torch = self._torch
        with self._lock, torch.no_grad():
            version = self._version
            results: dict[int, Generation] = {}
            # One batch per temperature (the agent loops of a node normally share one).
            for temp in sorted({r.temperature for r in requests}):
                idx = [i for i, r in enumerate(requests) if r.temperature == temp]
                gens = self._batch([requests[i] for i in idx], temp, version)
                results.update(zip(idx, gens, strict=True))
            self._requests += len(requests)
            return [results[i] for i in range(len(requests))]

    def _batch(
        self, requests: list[GenerationRequest], temperature: float, version: int
    ) -> list[Generation]:
        torch = self._torch
        prompts = [np.asarray(r.prompt_ids, dtype=np.int64) for r in requests]
        if any(p.shape[0] == 0 for p in prompts):
            raise ValueError("a generation request needs at least one context token")
        lengths = [int(p.shape[0]) for p in prompts]
        matches = [self.kv.match(p) if self.kv_reuse else (None, 0) for p in prompts]
        served = [c for _, c in matches]  # context tokens a cache held before this call
        # where each row's cached prefix comes from: the store, or a catch-up prefill
        sources = [(self.kv.get(k) if k is not None else None, c) for k, c in matches]
        if self.kv_reuse and len(prompts) > 1:
            sources = self._catch_up(prompts, sources)
        mask, ids, step_pos, cache, kept = self._layout(prompts, sources)
        rows = len(requests)
        # an entry that the new sequence extends (its ids are a prefix of the context)
        extends = [key is not None and reused == self.kv.get(key).length for key, reused in matches]
        reused = [min(k, c) for k, c in zip(kept, served, strict=True)]
        self.prefilled_tokens += sum(n - r for n, r in zip(lengths, reused, strict=True))
        self.reused_tokens += sum(reused)
        self.cache_hits += sum(1 for r in reused if r > 0)

        step_ids = ids
        next_pos = torch.tensor(lengths, dtype=torch.long)  # [B]
        limits = [r.max_new_tokens for r in requests]
        out_ids: list[list[int]] = [[] for _ in requests]
        out_lps: list[list[float]] = [[] for _ in requests]
        active = [limit > 0 for limit in limits]
        while any(active):
            out = self._forward(step_ids, mask, step_pos, cache)
            # the cache grew in place by the fed tokens
            logits = out.logits[:, -1, :].float() / temperature  # [B, V]
            logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
            tokens = torch.multinomial(logprobs.exp(), 1, generator=self._generator)  # [B, 1]
            for i, r in enumerate(requests):
                if r.seed is not None and active[i]:
                    tokens[i, 0] = _seeded_token(logprobs[i], r.seed, lengths[i] + len(out_ids[i]))
            chosen = logprobs.gather(-1, tokens).squeeze(-1).cpu()  # [B]
            tokens = tokens.squeeze(-1).cpu()  # [B]
            fed = torch.zeros((rows, 1), dtype=torch.long)  # [B, 1]: the next input's mask
            for i in range(rows):
                if not active[i]:
                    continue
                tok = int(tokens[i])
                out_ids[i].append(tok)
                out_lps[i].append(float(chosen[i]))
                self._tokens += 1  # progress as it happens: the heartbeat reports it
                if tok == self.eos_id or len(out_ids[i]) >= limits[i]:
                    active[i] = False
                else:
                    fed[i, 0] = 1
            if not any(active):
                break
            step_ids = torch.where(fed.bool(), tokens.unsqueeze(-1), self.pad_id)  # [B, 1]
            step_pos = next_pos.unsqueeze(-1).clone()  # [B, 1]
            next_pos += fed.squeeze(-1)
            mask = torch.cat([mask, fed], dim=-1)

        if self.kv_reuse and any(out_ids):
            # each row's KV covers the tokens it fed: its context and every generated token
            # but the last (a token is fed on the step after it is sampled)
            fed_ids = [
                np.concatenate([p, np.asarray(g[:-1], dtype=np.int64)])
                for p, g in zip(prompts, out_ids, strict=True)
            ]
            self._store(cache, mask, fed_ids, matches, extends)
        gens = []
        for toks, lps, r in zip(out_ids, out_lps, reused, strict=True):
            reason = "stop" if toks and toks[-1] == self.eos_id else "length"
            gens.append(Generation(toks, lps, reason, version, cached_tokens=r))
        return gens

    def _layout(self, prompts: list[np.ndarray], sources: list[Source]) -> Any:
        """The batch's first forward pass, right-aligned: the attention mask [B, K+S], the
        suffix window's ids and positions [B, S], the assembled cache of K positions and the
        cached tokens each row starts from. Positions come from each row's own token count,
        so left padding never shifts them."""
        torch = self._torch
        lengths = [int(p.shape[0]) for p in prompts]
        # The common suffix window: every row feeds its last S tokens (or all of them).
        width = max(n - c for n, (_, c) in zip(lengths, sources, strict=True))
        kept = [max(0, n - width) for n in lengths]  # cached tokens each row starts from
        past = max(kept)
        rows = len(prompts)
        mask = torch.zeros((rows, past + width), dtype=torch.long)  # [B, K+S]
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)  # [B, S]
        for i, (p, k) in enumerate(zip(prompts, kept, strict=True)):
            mask[i, past - k : past] = 1
            tail = p[k:]
            ids[i, width - tail.shape[0] :] = torch.from_numpy(tail)
            mask[i, past + width - tail.shape[0] :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, past:]  # [B, S]
        return mask, ids, positions, self._assemble(sources, kept, past), kept

    def _forward(self, ids: Any, mask: Any, positions: Any, cache: Any) -> Any:
        """One forward pass that feeds ``ids`` into ``cache`` (grown in place); only the last
        position's logits are computed."""
        dev = self.device
        return self.model(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            position_ids=positions.to(dev),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )

    def _catch_up(self, prompts: list[np.ndarray], sources: list[Source]) -> list[Source]:
        """Keep a few long uncached contexts from widening the whole batch's window: rows
        whose uncached part is much longer than the others' (new trajectories among
        continuing ones, a row whose cache was evicted) first prefill all but the batch's
        window together, on their own, so the batch does not feed B x the longest uncached
        part (``catch_up_width`` picks the window). The prefilled KV goes straight into the
        batch (not through the store, where it could evict the other rows' caches)."""
        uncached = [int(p.shape[0]) - c for p, (_, c) in zip(prompts, sources, strict=True)]
        width = catch_up_width(uncached, CATCH_UP_SLACK)
        late = [i for i, u in enumerate(uncached) if u > width]
        if not late:
            return sources
        heads = [prompts[i][: prompts[i].shape[0] - width] for i in late]
        mask, ids, positions, cache, _ = self._layout(heads, [sources[i] for i in late])
        self._forward(ids, mask, positions, cache)
        self.catch_ups += len(late)
        out = list(sources)
        for j, i in enumerate(late):
            out[i] = (self._row_entry(cache, mask, j, heads[j]), int(heads[j].shape[0]))
        return out

    def _assemble(self, sources: list[Source], kept: list[int], past: int) -> Any:
        """A batch cache of ``past`` positions: row i's first ``kept[i]`` cached tokens,
        right-aligned (left-padded with zeros that the attention mask hides)."""
        torch = self._torch
        if past == 0:
            return self._DynamicCache(config=self.model.config)
        rows = len(sources)
        entries = [e if k else None for (e, _), k in zip(sources, kept, strict=True)]
        template = next(e for e in entries if e is not None)
        layers = []
        for layer, (k0, v0) in enumerate(template.kv):
            heads, _, dim = k0.shape
            keys = torch.zeros((rows, heads, past, dim), dtype=k0.dtype, device=k0.device)
            values = torch.zeros(
                (rows, v0.shape[0], past, v0.shape[2]), dtype=v0.dtype, device=v0.device
            )
            for i, (entry, k) in enumerate(zip(entries, kept, strict=True)):
                if entry is not None:
                    keys[i, :, past - k :] = entry.kv[layer][0][:, :k]
                    values[i, :, past - k :] = entry.kv[layer][1][:, :k]
            layers.append((keys, values))
        return self._DynamicCache(ddp_cache_data=layers, config=self.model.config)

    def _row_entry(self, cache: Any, mask: Any, row: int, fed_ids: np.ndarray) -> KVEntry:
        """Row ``row``'s KV out of a batch cache, for the tokens it fed (``fed_ids``)."""
        torch = self._torch
        columns = torch.nonzero(mask[row], as_tuple=True)[0]  # [L]
        if columns.shape[0] != fed_ids.shape[0]:  # pragma: no cover - an engine bug
            raise AssertionError("the batch cache does not cover the row's tokens")
        columns = columns.to(self.device)
        kv = [
            (layer.keys[row].index_select(1, columns), layer.values[row].index_select(1, columns))
            for layer in cache.layers
        ]
        return KVEntry(fed_ids, kv)

    def _store(
        self,
        cache: Any,
        mask: Any,
        fed: list[np.ndarray],
        matches: list[tuple[int | None, int]],
        extends: list[bool],
    ) -> None:
        """Keep each row's KV for the tokens it fed (``fed[i]``, in order)."""
        for i, fed_ids in enumerate(fed):
            entry = self._row_entry(cache, mask, i, fed_ids)
            self.kv.put(entry, supersedes=matches[i][0] if extends[i] else None)

    def load_weights(self, version: int, location: str) -> None:

        with self._lock:
            try:
                if lora.is_adapter(location):  # LoRA: the adapter onto the base weights
                    lora.load_adapter(self.model, location, f"version {version}")
                else:
                    load_into(self.model, location)  # the file's bytes into the parameters
            except ValueError as e:
                raise ValueError(f"weights of version {version} do not fit the model: {e}") from e
            self._version = version
            self.kv.clear()  # computed with the old weights

    def load_state(
        self, version: int, state: dict[str, Any], adapter: dict[str, Any] | None = None
    ) -> None:
        """``load_weights`` from tensors in memory (a broadcast's, collective transport): the
        weights, or with ``adapter`` (its peft config) a LoRA version's adapter."""
        where = f"version {version} as received"
        with self._lock:
            try:
                if adapter is not None:
                    lora.apply_adapter(self.model, state, adapter, where)
                else:
                    copy_into(self.model, state, where)
            except ValueError as e:
                raise ValueError(f"weights of version {version} do not fit the model: {e}") from e
            self._version = version
            self.kv.clear()

    def health(self) -> EngineHealth:
        return EngineHealth(self._version, self._tokens, self._requests)


def _seeded_token(logprobs: Any, seed: int, position: int) -> int:
    """The token at ``position`` by inverse-CDF sampling with a uniform number of
    ``(seed, position)`` alone (``GenerationRequest.seed``), in float64 over the row's
    probabilities: the batch a row shares and the requests before it do not change it."""
    u = np.random.default_rng(seeded(seed, position)).random()
    cdf = np.cumsum(np.exp(logprobs.double().cpu().numpy()))
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), cdf.shape[0] - 1))
