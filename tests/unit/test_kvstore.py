"""The hf engine's KV store: longest-prefix matching, superseding, the token budget."""

from __future__ import annotations

import numpy as np

from rollcall.workers.rollout.engines.kvstore import KVEntry, KVStore, common_prefix


def _entry(ids: list[int]) -> KVEntry:
    return KVEntry(np.asarray(ids, dtype=np.int64), kv=[])


def _arr(ids: list[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64)


def test_common_prefix() -> None:
    assert common_prefix(_arr([1, 2, 3]), _arr([1, 2, 4])) == 2
    assert common_prefix(_arr([1, 2]), _arr([1, 2, 3])) == 2
    assert common_prefix(_arr([5]), _arr([1])) == 0
    assert common_prefix(_arr([]), _arr([1])) == 0


def test_match_takes_the_longest_prefix_and_always_leaves_one_token_to_feed() -> None:
    store = KVStore(max_tokens=100)
    store.put(_entry([1, 2, 3]))  # key 0
    store.put(_entry([1, 2, 3, 4, 5]))  # key 1
    store.put(_entry([9, 9]))  # key 2
    assert store.match(_arr([1, 2, 3, 4, 5, 6])) == (1, 5)
    # the prompt equals an entry: its last token must still be fed (it gives the next logits)
    assert store.match(_arr([1, 2, 3, 4, 5])) == (1, 4)
    # another branch of the same prefix: the shared part of the longer entry
    assert store.match(_arr([1, 2, 3, 7])) == (0, 3)
    assert store.match(_arr([7, 7])) == (None, 0)


def test_an_extending_entry_supersedes_the_one_it_extends() -> None:
    store = KVStore(max_tokens=100)
    store.put(_entry([1, 2, 3]))
    key, _ = store.match(_arr([1, 2, 3, 4]))
    store.put(_entry([1, 2, 3, 4, 5]), supersedes=key)
    assert len(store) == 1 and store.tokens == 5
    assert store.match(_arr([1, 2, 3, 9]))[1] == 3  # the new entry still serves the prefix


def test_the_least_recently_used_entries_go_first_when_over_budget() -> None:
    store = KVStore(max_tokens=10)
    store.put(_entry([1, 1, 1, 1]))  # key 0
    store.put(_entry([2, 2, 2, 2]))  # key 1
    assert store.match(_arr([1, 1, 1, 1, 1]))[0] == 0  # key 0 is now the most recent
    store.put(_entry([3, 3, 3, 3]))  # 12 tokens > 10: key 1 (least recent) goes
    assert store.tokens == 8 and len(store) == 2
    assert store.match(_arr([2, 2, 2]))[0] is None
    assert store.match(_arr([1, 1, 1]))[0] == 0
    store.put(_entry(list(range(11))))  # larger than the whole budget: not kept
    assert store.tokens == 8
    store.clear()
    assert len(store) == 0 and store.tokens == 0
