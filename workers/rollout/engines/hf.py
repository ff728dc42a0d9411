"""The ``hf`` engine: transformers on CPU or GPU, the default engine and the one tests use.

Concurrent requests are generated as one left-padded batch. A request that arrives alone and
continues the sequence generated last (the next turn of the same trajectory: its context starts
with the cached tokens) reuses that sequence's KV cache instead of prefilling the whole context
again (``kv_reuse``); the cache is dropped when new weights are loaded. Behaviour log-probs
come from the raw logits divided by the temperature (``output_logits``), never from the
processed scores (which would include top-k and other warpers): with plain sampling at
temperature T they are exactly the log-probs of the distribution the tokens were drawn from.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from workers.rollout.engines.base import EngineHealth, Generation, GenerationRequest


class HFEngine:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "cpu",
        version: int = 0,
        seed: int = 0,
        kv_reuse: bool = True,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._torch = torch
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(str(model_dir))
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        self.eos_id = int(self.tokenizer.eos_token_id)
        self.pad_id = int(self.tokenizer.pad_token_id)
        self._version = version
        self._tokens = 0
        self._requests = 0
        self._lock = threading.Lock()
        self.kv_reuse = kv_reuse
        self._cache: Any = None  # KV cache of the last single-request generation ...
        self._cache_ids: list[int] = []  # ... and the tokens it covers
        self.cache_hits = 0
        torch.manual_seed(seed)

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
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for row, r in enumerate(requests):  # left padding
            ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids) :] = 1
        max_new = max(r.max_new_tokens for r in requests)
        reuse: dict[str, Any] = {}
        single = len(requests) == 1 and self.kv_reuse
        if single and self._cache is not None:
            n = len(self._cache_ids)
            prompt = requests[0].prompt_ids
            if len(prompt) > n and prompt[:n] == self._cache_ids:
                reuse["cache"] = self._cache
                self.cache_hits += 1
        self._cache, self._cache_ids = None, []
        result = self.model.generate(
            **reuse,
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        if single and getattr(result, "cache", None) is not None:
            covered = result.cache.get_seq_length()
            self._cache, self._cache_ids = result.cache, result.sequences[0, :covered].tolist()
        new = result.sequences[:, width:]  # [B, T]
        logits = torch.stack(result.logits, dim=1).float() / temperature  # [B, T, V]
        logprobs = (
            torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        )  # [B, T]
        gens = []
        for row, r in enumerate(requests):
            toks = new[row].tolist()
            lps = logprobs[row].tolist()
            limit = r.max_new_tokens
            if self.eos_id in toks[:limit]:
                end = toks.index(self.eos_id) + 1
                reason = "stop"
            else:
                end = min(limit, len(toks))
                reason = "length"
            gens.append(Generation(toks[:end], lps[:end], reason, version))
            self._tokens += end
        return gens

    def load_weights(self, version: int, location: str) -> None:
        from safetensors.torch import load_file

        state = load_file(str(Path(location) / "model.safetensors"), device=str(self.device))
        with self._lock:
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            bad = [k for k in missing if "lm_head" not in k] + list(unexpected)
            if bad:
                raise ValueError(f"weights of version {version} do not fit the model: {bad[:5]}")
            self._version = version
            self._cache, self._cache_ids = None, []  # computed with the old weights

    def health(self) -> EngineHealth:
        return EngineHealth(self._version, self._tokens, self._requests)
