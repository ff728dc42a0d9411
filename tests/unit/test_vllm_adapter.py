"""The vllm adapter's pure parts: turning a finished completion into a ``Generation``, and the
gate that gives a weight load the engine alone. (vLLM itself only runs on GPU machines:
``ops/gpu/vllm_smoke.py`` checks the adapter against it; nothing here fakes vLLM.)"""

from __future__ import annotations

import asyncio

import pytest

from rollcall.workers.episode.engine import Generation
from rollcall.workers.rollout.engines.vllm import Gate, sampled_generation

EOS = 2


def test_a_completion_becomes_a_generation_with_the_sampled_tokens_logprobs() -> None:
    # Step 1 holds the sampled token 7 (-1.25) and a likelier token 3 (-0.1), as vLLM returns
    # when the sampled token is not the top one: the sampled token's value is taken.
    steps = [{5: -0.5}, {7: -1.25, 3: -0.1}, {EOS: -0.01}]
    g = sampled_generation([5, 7, EOS], steps, "stop", {EOS}, 4)
    assert g == Generation([5, 7, EOS], [-0.5, -1.25, -0.01], "stop", 4)
    cut = sampled_generation([5, 7], steps[:2], "length", {EOS}, 4)
    assert cut == Generation([5, 7], [-0.5, -1.25], "length", 4)


@pytest.mark.parametrize(
    ("ids", "steps", "reason", "match"),
    [
        ([5], [{5: -0.5}], "abort", "finish_reason 'abort'"),
        ([5], [{5: -0.5}], None, "finish_reason None"),
        ([5], None, "length", "None log-prob steps for 1 tokens"),
        ([5, 7], [{5: -0.5}], "length", "1 log-prob steps for 2 tokens"),
        ([5, 7], [{5: -0.5}, {3: -0.1}], "length", "no log-prob for sampled token 7 at step 1"),
        ([5, 7], [{5: -0.5}, {7: -0.1}], "stop", "does not end in a stop token"),
    ],
)
def test_a_completion_without_what_a_trajectory_needs_is_an_error(
    ids: list[int], steps: list[dict[int, float]] | None, reason: str | None, match: str
) -> None:
    with pytest.raises(RuntimeError, match=match):
        sampled_generation(ids, steps, reason, {EOS}, 0)


def test_a_load_waits_for_generations_in_flight_and_holds_back_later_ones() -> None:
    events: list[str] = []

    async def scenario() -> None:
        gate = Gate()
        release = asyncio.Event()

        async def generation(name: str) -> None:
            async with gate.shared():
                events.append(f"{name} in")
                await release.wait()
                events.append(f"{name} out")

        async def load() -> None:
            async with gate.exclusive():
                events.append("load in")
                await asyncio.sleep(0)
                events.append("load out")

        first = [asyncio.create_task(generation(n)) for n in ("a", "b")]
        await asyncio.sleep(0)  # both are in flight
        loading = asyncio.create_task(load())
        await asyncio.sleep(0)  # the load waits for them
        late = asyncio.create_task(generation("c"))
        await asyncio.sleep(0)  # and c waits for the load
        assert events == ["a in", "b in"] and gate.active == 2
        release.set()
        await asyncio.gather(*first, loading, late)

    asyncio.run(scenario())
    assert events == ["a in", "b in", "a out", "b out", "load in", "load out", "c in", "c out"]


@pytest.mark.parametrize(("device", "gpus"), [("cuda", 1), ("cuda", 2), ("cpu", 1)])
def test_the_worker_is_always_a_process_of_its_own(device: str, gpus: int) -> None:
    """On one GPU vLLM would run the worker (and the watchdog with it) inside the EngineCore,
    where a hung EngineCore would stop the watchdog too and outlive its node."""
    from rollcall.orchestrator.config import VLLMEngineConfig
    from rollcall.workers.rollout.engines.vllm_start import engine_kwargs

    config = VLLMEngineConfig(device=device, tensor_parallel_size=gpus)
    kwargs = engine_kwargs("/m", config, seed=3)
    assert kwargs["distributed_executor_backend"] == "mp"
    assert (kwargs["model"], kwargs["seed"], kwargs["tensor_parallel_size"]) == ("/m", 3, gpus)
