"""Dynamic batching: the concurrent agent loops of a node share one engine call.

Each loop submits its request and blocks; one dispatcher thread takes every request pending at
that moment (up to ``max_batch``) and runs them as one ``generate`` call. A loop that arrives
while a batch runs joins the next one, so batches grow with the load and a lone loop is never
delayed by a fixed window.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

from rollcall.workers.episode.engine import (
    Engine,
    EngineHealth,
    Generation,
    GenerationRequest,
)


class BatchingEngine:
    def __init__(self, engine: Engine, max_batch: int = 16) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_batch = max_batch
        self._queue: queue.Queue[tuple[GenerationRequest, Future[Generation]] | None] = (
            queue.Queue()
        )
        self.batches = 0
        self.batched_requests = 0
        self._thread = threading.Thread(target=self._dispatch, name="engine-batcher", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return self.engine.version

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        futures: list[Future[Generation]] = []
        for r in requests:
            f: Future[Generation] = Future()
            self._queue.put((r, f))
            futures.append(f)
        return [f.result() for f in futures]

    def _dispatch(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < self.max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
            try:
                gens = self.engine.generate([r for r, _ in batch])
                for (_, f), g in zip(batch, gens, strict=True):
                    f.set_result(g)
            except BaseException as e:  # the loops see the engine's failure
                for _, f in batch:
                    f.set_exception(e)
            self.batches += 1
            self.batched_requests += len(batch)

    def load_weights(self, version: int, location: str) -> None:
        self.engine.load_weights(version, location)

    def health(self) -> EngineHealth:
        return self.engine.health()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
