"""What a writer knows is stored of each sample it holds, so a checkpoint sends only new turns.

A sample's payload is stored append-only (``trajectory_segments``): a write carries the tokens
from an offset on, and the database keeps the segments before it. The offset is the length of
the payload this writer last stored for the sample under the same lease, or of the checkpoint
its claim loaded, provided the new payload extends it exactly (tokens, mask and log-probs);
otherwise (a trajectory that started over, a sample this writer never stored, or one it
forgot) it is 0 and the whole payload is written again. The database checks the offset against
its segments (outcome ``rebase`` when they disagree), so a wrong guess costs a rewrite, never a
wrong payload.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from rollcall.orchestrator.domain import TrajectoryPayload

# (episode id, lease epoch, sample index)
Key = tuple[int, int, int]

# Samples remembered at most (least recently written forgotten first): a node holds far fewer
# in flight; forgetting one costs a full rewrite at its next checkpoint.
MAX_SAMPLES = 4096


class StoredPrefixes:
    """Thread-safe: a node checkpoints its samples from several threads."""

    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        self._max = max_samples
        self._stored: OrderedDict[Key, TrajectoryPayload] = OrderedDict()
        self._lock = threading.Lock()

    def start(self, key: Key, payload: TrajectoryPayload) -> int:
        """Where the write of ``payload`` begins: the stored length if it extends what is
        stored, else 0."""
        with self._lock:
            stored = self._stored.get(key)
        if stored is None or not payload.extends(stored):
            return 0
        return stored.num_tokens

    def stored(self, key: Key, payload: TrajectoryPayload) -> None:
        with self._lock:
            self._stored[key] = payload
            self._stored.move_to_end(key)
            while len(self._stored) > self._max:
                self._stored.popitem(last=False)

    def forget(self, key: Key) -> None:
        with self._lock:
            self._stored.pop(key, None)

    def forget_episode(self, episode_id: int) -> None:
        with self._lock:
            for key in [k for k in self._stored if k[0] == episode_id]:
                del self._stored[key]

    def __len__(self) -> int:
        return len(self._stored)
