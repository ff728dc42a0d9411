"""The ``hf`` engine's store of KV caches, one entry per sequence it generated, for reuse.

An entry holds the key/value tensors of every layer for the tokens it covers. A request whose
context shares a prefix with an entry (the next turn of the same trajectory shares all of it;
another sample of the same prompt shares the prompt) starts from that entry's KV instead of
prefilling the shared tokens again. Entries are found by the longest common token prefix, so
nothing outside the token ids (no trajectory id) is trusted: a match is a match by
construction. The store keeps at most ``max_tokens`` tokens in all and evicts the least
recently used entries first. It owns no model: the engine fills and reads it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class KVEntry:
    ids: np.ndarray  # [L] int64: the tokens whose keys and values are cached
    kv: list[tuple[Any, Any]]  # per layer (keys, values), each [heads, L, head_dim]

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D token arrays."""
    m = min(a.shape[0], b.shape[0])
    if m == 0:
        return 0
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


class KVStore:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, KVEntry] = OrderedDict()
        self._next = 0
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt: np.ndarray) -> tuple[int | None, int]:
        """The entry sharing the longest prefix with ``prompt`` and that length (at most
        ``len(prompt) - 1``: the last prompt token is always fed, it yields the next logits)."""
        best, best_len = None, 0
        limit = prompt.shape[0] - 1
        for key, entry in self._entries.items():
            n = min(common_prefix(entry.ids, prompt), limit)
            if n > best_len:
                best, best_len = key, n
        if best is not None:
            self._entries.move_to_end(best)
        return best, best_len

    def get(self, key: int) -> KVEntry:
        return self._entries[key]

    def put(self, entry: KVEntry, *, supersedes: int | None = None) -> None:
        """Add ``entry``; ``supersedes`` names an entry it extends (its ids are a prefix of
        the new entry's), which is dropped: every match it could give, the new one gives."""
        if supersedes is not None and supersedes in self._entries:
            self.tokens -= self._entries.pop(supersedes).length
        if entry.length > self.max_tokens:
            return
        self._entries[self._next] = entry
        self._next += 1
        self.tokens += entry.length
        while self.tokens > self.max_tokens:
            _, old = self._entries.popitem(last=False)
            self.tokens -= old.length

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0
