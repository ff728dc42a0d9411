"""Engines are named in the config (a discriminated union on ``kind``), never imported by path."""

from __future__ import annotations

from pathlib import Path

from rollcall.orchestrator.config import (
    EngineConfig,
    HFEngineConfig,
    TimingEngineConfig,
    VLLMEngineConfig,
)
from rollcall.workers.episode.engine import Engine
from rollcall.workers.rollout.engines.hf import HFEngine
from rollcall.workers.rollout.engines.timing import TimingEngine
from rollcall.workers.rollout.engines.vllm import VLLMEngine


def preload(config: EngineConfig) -> None:
    """Import the engine's libraries (torch, transformers, vLLM) without building anything. A
    node does this before it registers: importing them holds the interpreter for seconds at a
    time (C extensions initialise under the GIL), which no heartbeat thread can run through,
    so it belongs to the start phase judged by ``start_timeout_s``, not to the beating one."""
    if isinstance(config, TimingEngineConfig):
        return
    import torch  # noqa: F401
    import transformers  # noqa: F401

    if isinstance(config, VLLMEngineConfig):
        import vllm  # noqa: F401


def make_engine(
    config: EngineConfig,
    model_dir: str | Path,
    *,
    seed: int = 0,
    threads: int = 0,
    lora_rank: int | None = None,
) -> Engine:
    """The configured engine. ``threads`` > 0 caps torch's CPU threads (engines on torch);
    ``lora_rank``: the trainer publishes LoRA adapters of that rank (vLLM must know at start;
    the ``hf`` engine takes them as they come)."""
    if isinstance(config, TimingEngineConfig):  # no torch: a benchmark's timing model
        return TimingEngine(config, model_dir, seed=seed)
    if threads > 0:
        import torch

        torch.set_num_threads(threads)
    if isinstance(config, HFEngineConfig):
        return HFEngine(
            model_dir,
            device=config.device,
            seed=seed,
            kv_cache_tokens=config.kv_cache_tokens,
            dtype=config.dtype,
        )
    if isinstance(config, VLLMEngineConfig):
        return VLLMEngine(model_dir, config, seed=seed, lora_rank=lora_rank)
    raise TypeError(f"unknown engine config {config!r}")  # pragma: no cover
