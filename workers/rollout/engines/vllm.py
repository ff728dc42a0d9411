"""The ``vllm`` engine: vLLM's async engine (``AsyncLLM``, v1) behind the engine protocol.

A thin adapter for GPU machines, written against vLLM's documented API and installed with the
optional ``rollcall[vllm]`` extra (``vllm>=0.10.2``; CUDA only). Importing this module is always
safe; constructing the engine without vLLM raises ``EngineUnavailable`` with the fix. It has not
been run in this project yet (no GPU machine with vLLM); ``ops/gpu/vllm_smoke.py`` is the check
to run where one is.

What it owns and guarantees:

- One ``AsyncLLM`` (``AsyncLLM.from_engine_args(AsyncEngineArgs(...))``) runs on its own asyncio
  event loop in a background thread; the protocol's calls are synchronous and block the calling
  thread only. ``generate`` submits every request as its own vLLM request (a unique request id,
  ``TokensPrompt(prompt_token_ids=...)``, ``RequestOutputKind.FINAL_ONLY``) and waits for all of
  them, so vLLM's continuous batching does the batching: ``batches_itself`` tells the rollout
  node to hand each agent loop's request straight to the engine (no ``BatchingEngine``).
- Prompts are token ids and outputs are token ids (``detokenize=False``): the trajectory stays
  token-in/token-out. The stop token (the tokenizer's EOS, the same one the ``hf`` engine stops
  at) is part of the returned tokens; ``generation_config="vllm"`` keeps the model folder's
  generation config from adding stop tokens or sampling defaults.
- Behaviour log-probs: ``logprobs_mode="processed_logprobs"`` with ``logprobs=0`` returns, for
  each sampled token, its log-prob under the distribution it was sampled from. vLLM's engine
  arguments page (https://docs.vllm.ai/en/latest/configuration/engine_args/, ``--logprobs-mode``;
  the docstring of ``ModelConfig.logprobs_mode`` in ``vllm/config/model.py``) lists four modes,
  ``raw_logprobs`` (the default), ``raw_logits``, ``processed_logprobs`` and
  ``processed_logits``: "Raw means the values before applying any logit processors ...
  Processed means the values after applying all processors, including temperature and
  top_k/top_p." ``raw_logprobs`` would be the log-softmax of the unscaled logits (wrong at any
  temperature but 1); the ``*_logits`` modes are not log-probs (and the sampler of vLLM's newer
  GPU model runner accepts only the two ``*_logprobs`` modes). Sampling sets no top-k
  (``top_k=-1``), no top-p (``top_p=1``), no min-p and no penalties, so "after all processors"
  is exactly ``log_softmax(logits / T)``, what the trainer's loss recomputes. In vLLM 0.10.0 the
  processed values were taken before temperature (prime-rl PR #697 patched vLLM's sampler for
  it); vLLM PR #22387 ("Support returning final logprobs") made them the values after
  temperature and top-k/top-p, hence ``vllm>=0.10.2``.
- Weights of a version load from a published folder (``model.safetensors``) through a worker
  extension (``worker_extension_cls``: ``RollcallWorkerExtension``, mixed into each vLLM GPU
  worker) called with ``AsyncLLM.collective_rpc`` (a coroutine). A load waits for the
  generations in flight to finish and holds new ones back, so every generation is made under
  one version; after the load the prefix cache is reset (its KV was computed with the old
  weights) and only then does the version advance. A load that fails inside vLLM leaves the
  weights possibly half replaced: generation then fails until a later load succeeds.
- ``health()``: version, tokens generated, requests. ``close()`` shuts vLLM down and stops the
  loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import threading
import uuid
from collections.abc import AsyncIterator, Collection, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from workers.rollout.engines.base import EngineHealth, Generation, GenerationRequest

WEIGHTS_FILE = "model.safetensors"  # what ``workers.trainer.weights.publish`` writes
RESET_ATTEMPTS = 20  # reset_prefix_cache returns False while blocks are still in use ...
RESET_RETRY_S = 0.05  # ... which right after the last request finished is a matter of a step

T = TypeVar("T")


class EngineUnavailable(RuntimeError):
    pass


def sampled_generation(
    token_ids: Sequence[int],
    step_logprobs: Sequence[Mapping[int, float]] | None,
    finish_reason: str | None,
    stop_ids: Collection[int],
    version: int,
    cached_tokens: int = 0,
) -> Generation:
    """A ``Generation`` from one finished vLLM completion given as plain values: its token ids,
    per generated token a ``{token id: log-prob}`` map (vLLM's ``CompletionOutput.logprobs``
    with ``logprobs=0`` holds the sampled token's entry), and its finish reason. Anything but a
    stop or a length cut (an abort, missing log-probs, a stop without its stop token) raises:
    a trajectory must never carry tokens without their behaviour log-probs."""
    ids = [int(t) for t in token_ids]
    if finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM request ended with finish_reason {finish_reason!r}")
    if step_logprobs is None or len(step_logprobs) != len(ids):
        got = None if step_logprobs is None else len(step_logprobs)
        raise RuntimeError(f"vLLM returned {got} log-prob steps for {len(ids)} tokens")
    logprobs = []
    for i, (tok, step) in enumerate(zip(ids, step_logprobs, strict=True)):
        if tok not in step:
            raise RuntimeError(f"vLLM returned no log-prob for sampled token {tok} at step {i}")
        logprobs.append(float(step[tok]))
    if finish_reason == "stop" and (not ids or ids[-1] not in stop_ids):
        raise RuntimeError(f"vLLM reported a stop, but {ids[-3:]} does not end in a stop token")
    return Generation(ids, logprobs, finish_reason, version, cached_tokens=cached_tokens)


class Gate:
    """Generations share the engine; a weight load has it alone. Used on one event loop: a
    load waits for the generations in flight and holds new ones back until it is done (a load
    that is waiting goes before generations that arrive after it)."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._active = 0
        self._exclusive = False

    @property
    def active(self) -> int:
        return self._active

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._exclusive)
            self._active += 1
        try:
            yield
        finally:
            async with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._exclusive)
            self._exclusive = True
            try:
                await self._cond.wait_for(lambda: self._active == 0)
            except BaseException:
                self._exclusive = False
                self._cond.notify_all()
                raise
        try:
            yield
        finally:
            async with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class RollcallWorkerExtension:
    """Mixed into each of vLLM's GPU workers (``worker_extension_cls``, by qualified name) and
    called through ``collective_rpc``: load a published version's weights into the worker's
    model (each tensor-parallel worker takes its shard in ``load_weights``)."""

    model_runner: Any

    def rollcall_load_weights(self, location: str) -> int:
        from safetensors.torch import load_file

        state = load_file(str(Path(location) / WEIGHTS_FILE), device="cpu")
        model = self.model_runner.model
        expected = {name for name, _ in model.named_parameters()}
        loaded = model.load_weights(weights=iter(state.items()))
        quantized = getattr(getattr(self, "model_config", None), "quantization", None)
        if loaded is not None and quantized is None:  # the names it set; vLLM's loader checks so
            missing = sorted(expected - set(loaded))
            if missing:
                raise ValueError(f"{location} left parameters unset: {missing[:5]}")
        return len(state)


class VLLMEngine:
    batches_itself = True  # vLLM's continuous batching: the node sends each request directly

    def __init__(
        self,
        model_dir: str | Path,
        *,
        gpu_memory_utilization: float = 0.85,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        max_model_len: int | None = None,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        max_num_seqs: int | None = None,
        version: int = 0,
        seed: int = 0,
    ) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise EngineUnavailable(
                "the vllm engine needs vLLM, which installs only on machines with a CUDA GPU: "
                "pip install 'rollcall[vllm]', or use engine kind 'hf'"
            )
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.eos_id = int(self.tokenizer.eos_token_id)
        args = AsyncEngineArgs(
            model=str(model_dir),
            seed=seed,
            dtype=dtype,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            enforce_eager=enforce_eager,
            max_num_seqs=max_num_seqs,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            worker_extension_cls=f"{__name__}.{RollcallWorkerExtension.__name__}",
            disable_log_stats=True,
        )
        self._version = version
        self._tokens = 0
        self._requests = 0
        self._broken: str | None = None  # set while the weights may be half replaced
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="vllm-engine-loop", daemon=True
        )
        self._thread.start()
        try:
            self._engine, self._gate = self._call(self._start(args))
        except BaseException:
            self._stop_loop()
            raise

    # -- the engine protocol --------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        if not requests:
            return []
        return self._call(self._generate(requests))

    def load_weights(self, version: int, location: str) -> None:
        path = Path(location) / WEIGHTS_FILE
        if not path.is_file():  # pruned or never written: the node waits for the next version
            raise FileNotFoundError(f"no weights of version {version} at {path}")
        self._call(self._load(version, location))

    def health(self) -> EngineHealth:
        return EngineHealth(self._version, self._tokens, self._requests)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._shutdown())
        finally:
            self._stop_loop()

    # -- on the engine's event loop -------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed() or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the vllm engine is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _start(self, args: Any) -> tuple[Any, Gate]:
        # Built on its loop, as vLLM's API server builds it: the output handler task that
        # feeds every request's results runs on this loop.
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(args), Gate()

    async def _generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        async with self._gate.shared():
            if self._broken is not None:
                raise RuntimeError(self._broken)
            version = self._version
            params = [
                SamplingParams(
                    n=1,
                    temperature=r.temperature,
                    top_p=1.0,
                    top_k=-1,  # no top-k in every vLLM this supports (newer ones also read 0 so)
                    min_p=0.0,
                    max_tokens=r.max_new_tokens,
                    logprobs=0,  # the sampled token's log-prob only
                    stop_token_ids=[self.eos_id],
                    detokenize=False,
                    output_kind=RequestOutputKind.FINAL_ONLY,
                )
                for r in requests
            ]
            try:
                async with asyncio.TaskGroup() as tg:  # one failure cancels (aborts) the rest
                    tasks = [
                        tg.create_task(self._one(r.prompt_ids, p))
                        for r, p in zip(requests, params, strict=True)
                    ]
            except BaseExceptionGroup as group:
                raise group.exceptions[0] from group
            gens = [
                sampled_generation(
                    c.token_ids,
                    None if c.logprobs is None else [_plain(step) for step in c.logprobs],
                    c.finish_reason,
                    (self.eos_id,),
                    version,
                    cached,
                )
                for c, cached in (t.result() for t in tasks)
            ]
        self._tokens += sum(len(g.token_ids) for g in gens)
        self._requests += len(requests)
        return gens

    async def _one(self, prompt_ids: list[int], params: Any) -> tuple[Any, int]:
        """One request's completion, and its prompt tokens served from the prefix cache."""
        from vllm.inputs import TokensPrompt

        request_id = f"rollcall-{self._prefix}-{next(self._ids)}"
        final = None
        async for out in self._engine.generate(
            prompt=TokensPrompt(prompt_token_ids=list(prompt_ids)),
            sampling_params=params,
            request_id=request_id,
        ):
            final = out
        if final is None or not final.outputs:
            raise RuntimeError(f"vLLM returned no output for request {request_id}")
        return final.outputs[0], int(getattr(final, "num_cached_tokens", None) or 0)

    async def _load(self, version: int, location: str) -> None:
        async with self._gate.exclusive():
            try:
                await self._engine.collective_rpc("rollcall_load_weights", args=(location,))
                await self._reset_prefix_cache()
            except BaseException as e:
                self._broken = (
                    f"loading the weights of version {version} failed ({type(e).__name__}: "
                    f"{e}); the engine's weights may be half replaced until a load succeeds"
                )
                raise
            self._broken = None
            self._version = version

    async def _reset_prefix_cache(self) -> None:
        for _ in range(RESET_ATTEMPTS):
            # False while blocks are in use (newer vLLM); older versions return None.
            if await self._engine.reset_prefix_cache() is not False:
                return
            await asyncio.sleep(RESET_RETRY_S)
        raise RuntimeError("vLLM did not reset its prefix cache after new weights were loaded")

    async def _shutdown(self) -> None:
        self._engine.shutdown()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()


def _plain(step: Mapping[int, Any]) -> dict[int, float]:
    """vLLM's ``{token id: Logprob}`` for one step as ``{token id: log-prob}``."""
    return {int(tok): float(lp.logprob) for tok, lp in step.items()}
