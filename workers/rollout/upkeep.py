"""A rollout node's upkeep thread: the work on the engine that the heartbeat must not wait on.

Every ``heartbeat_interval_s`` it asks the engine whether it died (``failure()``, which never
blocks: a dead engine ends the node at once, also while it is idle), runs a one-token probe
when the node is idle or generated nothing since the last pass (progress without tokens), and
looks up the job's published weights, loading a newer version (``WeightSync.sync``). It may
wait on the engine; the beats do not, so a hung engine stops the node's progress, not its
beats, and the control plane declares it hung after ``progress_timeout_s``.
"""

from __future__ import annotations

import logging
import threading

from rollcall.workers.episode.engine import EngineFailure, GenerationRequest
from rollcall.workers.rollout.breaker import Breaker
from rollcall.workers.rollout.enginehost import EngineHost
from rollcall.workers.rollout.leases import LeaseBook
from rollcall.workers.rollout.stats import Counters
from rollcall.workers.rollout.weightsync import WeightSync

log = logging.getLogger(__name__)


class Upkeep:
    """The upkeep thread: runs every ``interval_s`` until ``beats_stop`` is set; once the node
    is stopping (``stop``) it only watches for the engine's death."""

    def __init__(
        self,
        interval_s: float,
        host: EngineHost,
        leases: LeaseBook,
        counters: Counters,
        weights: WeightSync,
        breaker: Breaker,
        *,
        stop: threading.Event,
        beats_stop: threading.Event,
    ) -> None:
        self.interval_s = interval_s
        self.host = host
        self.leases = leases
        self.counters = counters
        self.weights = weights
        self.breaker = breaker
        self.stop = stop
        self.beats_stop = beats_stop
        self._probe_tokens = -1  # tokens generated at the last upkeep pass
        self.thread = threading.Thread(target=self._run, name="upkeep", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def probe(self) -> None:
        """When idle, or busy but without a token generated since the last pass (the loops wait
        on user code), a one-token generation proves the engine still works (progress). It runs
        on the upkeep thread: a hung engine blocks it, so progress stops (not the beats) and
        the control plane declares the node hung after ``progress_timeout_s``."""
        base = self.host.base
        tokens = base.health().tokens_generated
        idle = self.leases.idle()
        # idle, or busy without generating (its loops wait on the user's code: slow tools,
        # synchronous work in an agent): the probe shows the engine itself still works
        stalled, self._probe_tokens = tokens == self._probe_tokens, tokens
        if idle or stalled:
            probe = getattr(base, "probe", None)
            if probe is not None:  # the engine's own probe (works while weights are broken)
                probe()
            else:
                eos = self.host.tokenizer.eos_token_id or 0
                self.host.engine.generate([GenerationRequest([eos], max_new_tokens=1)])
            self.counters.progressed()

    def _run(self) -> None:
        """Asks the engine whether it died (never blocks), probes it when idle, and loads newer
        weights. It may wait on the engine; the beats do not."""
        while not self.beats_stop.wait(self.interval_s):
            try:
                failure = getattr(self.host.base, "failure", None)
                reason = failure() if failure is not None else None
                if reason is not None:
                    self.breaker.engine_died(reason)
                    continue
                if self.stop.is_set():
                    continue
                self.probe()
                self.weights.sync()
            except EngineFailure as e:
                if e.fatal:
                    self.breaker.engine_died(str(e))
            except Exception:
                log.exception("upkeep failed")
