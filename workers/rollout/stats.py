"""A rollout node's counters: what its ``report`` returns (``NodeStats``), the progress its
heartbeat reports (probes and weight loads that ended) and its reports' sequence numbers, under
a lock of their own (never held across I/O)."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class NodeStats:
    episodes_committed: int = 0
    samples_committed: int = 0
    samples_resumed: int = 0
    episodes_released: int = 0
    episodes_abandoned: int = 0
    turns: int = 0
    weight_loads: int = 0
    weight_load_s_last: float = 0.0
    weight_load_s_total: float = 0.0
    agent_calls_replayed: int = 0  # episodes' calls answered from the record after a resume
    agent_calls_live: int = 0  # ... calls served now
    agent_generations: int = 0  # ... chat calls that ran the engine
    agent_divergences: int = 0  # ... replays that diverged (the sample restarted from scratch)
    user_errors: int = 0  # episodes failed by user code (the input's fault, not the node's)
    agent_runs_abandoned: int = 0  # agent runs past their timeout that could not be cancelled
    # (their threads are left to end on their own: each one still holds what it holds)
    tasks_paused: int = 0  # tasks this node paused because their code failed on most inputs
    episodes_handed_back: int = 0  # episodes given back at a turn boundary by a drain
    weights_received: int = 0  # versions loaded from a broadcast (collective transport)
    weights_receive_failed: int = 0  # broadcasts that did not complete here


class Counters:
    """The node's ``NodeStats`` and its progress counter. Every change is made under the
    counters' own lock; ``stats`` is the live object (read without the lock, as a report)."""

    def __init__(self) -> None:
        self.stats = NodeStats()
        self._lock = threading.Lock()
        self._progress = 0  # probes and weight loads that ended (progress without tokens)
        self._reports = 0  # reports made (their sequence numbers)

    def add(self, **counts: int) -> None:
        """Add to the named ``NodeStats`` counters at once."""
        with self._lock:
            for name, n in counts.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)

    def progressed(self) -> None:
        """A probe ended: the node works, whether or not it generated tokens."""
        with self._lock:
            self._progress += 1

    def progress(self) -> int:
        with self._lock:
            return self._progress

    def weights_loaded(self, took: float, *, received: bool = False) -> None:
        """A weight load ended in ``took`` seconds (``received``: from a broadcast): progress."""
        with self._lock:
            self._progress += 1
            if received:
                self.stats.weights_received += 1
            self.stats.weight_loads += 1
            self.stats.weight_load_s_last = took
            self.stats.weight_load_s_total += took

    def next_report(self) -> int:
        """The next report's sequence number (orders this incarnation's reports)."""
        with self._lock:
            self._reports += 1
            return self._reports

    def as_dict(self) -> dict[str, Any]:
        return asdict(self.stats)
