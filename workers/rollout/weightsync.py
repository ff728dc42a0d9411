"""A rollout node's weight sync: new policy versions, by file or by collective broadcast.

New weights are loaded between engine calls, so in-flight trajectories continue under the new
version and record it per turn (partial rollout). The node learns the job's published weights
with every claim (read after the lease was taken: loaded before the claim is rolled out) and at
every pass of its upkeep thread; ``load_weights`` loads a version on demand.

Files (``trainer.weights.transport: files``): a newer published version is loaded from its
files at once. Collective: a version published while the node runs arrives by broadcast
(``receive``); its file is loaded only when the broadcast failed here (``missed``), or has not
come ``weights_grace_s`` after the version was first seen. Weights that failed to load keep the
node from claiming (``error``) until a later version loads.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from rollcall.orchestrator.buffer.rollout import RolloutBuffer
from rollcall.workers import collective
from rollcall.workers.episode.engine import EngineFailure
from rollcall.workers.rollout.breaker import Breaker
from rollcall.workers.rollout.enginehost import EngineHost
from rollcall.workers.rollout.stats import Counters

if TYPE_CHECKING:
    from rollcall.workers.rollout.node import NodeConfig

log = logging.getLogger(__name__)


class WeightSync:
    """The node's weight loads, one at a time (the sync's own lock), and what it knows of the
    published versions."""

    def __init__(
        self,
        config: NodeConfig,
        buffer: RolloutBuffer,
        host: EngineHost,
        counters: Counters,
        breaker: Breaker,
    ) -> None:
        self.config = config
        self.buffer = buffer
        self.host = host
        self.counters = counters
        self.breaker = breaker
        self._load_lock = threading.Lock()
        self.loading = False  # a weight load is in progress
        self.error: str | None = None  # the last load failed: no claims until one works
        self._bad_version = -1  # the version whose load failed (not retried)
        # collective transport: when each newer published version was first seen, the versions
        # whose broadcast failed here (loaded from files at once), and the first check done
        self._seen_at: dict[int, float] = {}
        self._missed: set[int] = set()
        self._checked_once = False

    def explains(self, error: Exception | None) -> bool:
        """Whether an engine failure is explained by the weights: they are being replaced or
        failed to load (the node already stops claiming until a later version loads)."""
        return isinstance(error, EngineFailure) and (self.error is not None or self.loading)

    def sync(self) -> None:
        """Load the job's latest published weights if they are newer than the engine's."""
        self.load_if_newer(self.buffer.published_weights())

    def load_if_newer(self, published: tuple[int, str] | None) -> None:
        engine = self.host.engine
        if published is None or published[0] <= max(engine.version, self._bad_version):
            self._checked_once = True
            return
        if self._awaiting_broadcast(published[0]):
            return
        with self._load_lock:
            if published[0] > max(engine.version, self._bad_version):
                self.loading = True
                try:
                    self._load(*published)
                    self.error = None
                except FileNotFoundError:  # pruned while we looked: the next one will be there
                    log.warning("weights of version %s are gone; waiting for the next", published)
                except EngineFailure as e:
                    if e.fatal:
                        self.breaker.engine_died(str(e))
                        return
                    self._failed(published[0], e)
                except Exception as e:  # a corrupt or incomplete file: wait for the next one
                    self._failed(published[0], e)
                finally:
                    self.loading = False

    def _awaiting_broadcast(self, version: int) -> bool:
        """Collective transport: a version published while this node runs arrives by
        broadcast; its file is loaded only when the broadcast failed here, or has not come
        ``weights_grace_s`` after the version was first seen. The first check after the node
        starts loads from the file at once (catching up)."""
        if self.config.weights_transport != "collective":
            return False
        first = not self._checked_once
        self._checked_once = True
        if first or version in self._missed:
            return False
        seen = self._seen_at.setdefault(version, time.monotonic())
        return time.monotonic() - seen < self.config.weights_grace_s

    def missed(self, version: int) -> None:
        """Collective transport: the driver says this node did not get ``version`` by
        broadcast; it loads the version's file at its next weight check."""
        self._missed.add(version)

    def receive(self, offer: dict[str, Any]) -> dict[str, Any]:
        """Collective transport: join the offer's group and receive its version, then load it
        in place (the engine's lock, as a file load). A broadcast that fails here leaves the
        engine's weights as they were and the version to its file (at the node's next weight
        check). Returns what happened: ``{"loaded": bool, "error": str | None, ...}``."""
        base = self.host.base
        # A member always takes part (the group needs every rank), also when it has the
        # version already (from its file, after a failed attempt): it then only discards it.
        o = collective.Offer.from_json(offer)
        t0 = time.perf_counter()
        try:
            receive = getattr(base, "receive_weights", None)
            if receive is not None:  # the engine receives in its own process (vLLM's worker)
                with self._load_lock:
                    self.loading = True
                    try:
                        receive(o, who=self.config.name, address=collective.local_address())
                    finally:
                        self.loading = False
                    loaded = True
            else:
                staged = collective.receive(o, who=self.config.name)
                with self._load_lock:
                    loaded = o.version > self.host.engine.version
                    if loaded:
                        self.loading = True
                        try:
                            load_state = getattr(base, "load_state", None)
                            if load_state is None:
                                raise collective.BroadcastFailed(
                                    f"the {type(base).__name__} engine takes no broadcast weights"
                                )
                            load_state(o.version, staged, adapter=o.adapter)
                        finally:
                            self.loading = False
        except collective.BroadcastFailed as e:
            self._missed.add(o.version)
            self.counters.add(weights_receive_failed=1)
            log.warning("%s: %s; loading it from its file instead", self.config.name, e)
            return {"loaded": False, "error": str(e)}
        if not loaded:  # had it already
            return {"loaded": False, "error": None, "already": True}
        took = time.perf_counter() - t0
        self.counters.weights_loaded(took, received=True)
        self.error = None
        return {"loaded": True, "error": None, "seconds": took}

    def _failed(self, version: int, error: Exception) -> None:
        """A load failed inside the engine, which now serves nothing (its weights may be half
        replaced): claim nothing until a later version loads."""
        self._bad_version = version
        self.error = f"version {version}: {type(error).__name__}: {error}"
        log.error("loading weights failed (%s); waiting for the next version", self.error)

    def load(self, version: int, location: str) -> None:
        """Load ``version`` now (the remote ``load_weights``), one load at a time."""
        with self._load_lock:
            self._load(version, location)

    def _load(self, version: int, location: str) -> None:
        t0 = time.perf_counter()
        self.host.engine.load_weights(version, location)
        self.counters.weights_loaded(time.perf_counter() - t0)
