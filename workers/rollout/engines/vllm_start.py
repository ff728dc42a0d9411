"""What the ``vllm`` engine sets up before vLLM starts: its engine arguments, the checks that
refuse a wrong build or an unsupported head size with the fix, and a folder of its own for
vLLM's ZMQ sockets.

vLLM's processes talk over ``ipc://`` sockets, files under ``VLLM_RPC_BASE_PATH`` (by default
the temporary folder itself). A SIGKILLed EngineCore or node never unlinks them, so every
engine restart of a long job left a few files in ``/tmp`` for good. Each engine gets a folder
of its own instead (``rollcall-vllm-UID/PID-XXXX`` under the temporary folder, mode 0700),
removed when the engine closes, or by vLLM's worker once its watchdog finds the node gone
(``vllm_worker``: a node that was SIGKILLed never closes its engine); a start also removes
the folders of processes that are gone, should both have been killed at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

from rollcall.orchestrator import procfs
from rollcall.orchestrator.config import VLLMEngineConfig
from rollcall.workers.rollout.engines.vllm_worker import RollcallWorkerExtension


class EngineUnavailable(RuntimeError):
    pass


def socket_dir() -> Path:
    """A new folder for one engine's sockets, after removing those of processes now gone."""
    root = Path(tempfile.gettempdir()) / f"rollcall-vllm-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o700)
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():  # not ours: a folder alone
        return Path(tempfile.mkdtemp(prefix="rollcall-vllm-"))
    for old in root.iterdir():
        pid = old.name.split("-", 1)[0]
        if pid.isdigit() and not procfs.alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root))


# the LoRA ranks vLLM serves (``vllm.config.lora.MaxLoRARanks``)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def engine_kwargs(
    model_dir: str | Path, config: VLLMEngineConfig, seed: int, lora_rank: int | None = None
) -> dict[str, Any]:
    """vLLM's engine arguments for ``config``; with ``lora_rank``, LoRA adapters of up to that
    rank are served (one at a time: every generation is under one version)."""
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "seed": seed,
        "dtype": config.dtype,
        "tensor_parallel_size": config.tensor_parallel_size,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "enable_prefix_caching": config.enable_prefix_caching,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        # on CPU always eager: compiling for CPU adds minutes to every start
        "enforce_eager": config.enforce_eager or config.device == "cpu",
        "logprobs_mode": "processed_logprobs",
        "generation_config": "vllm",
        "worker_extension_cls": (
            f"{RollcallWorkerExtension.__module__}.{RollcallWorkerExtension.__name__}"
        ),
        "disable_log_stats": True,
        # Always the multiprocess executor: the worker (and its watchdog) is a process of its
        # own under the EngineCore, as on the CPU. On one GPU vLLM's default (``uni``) runs the
        # worker inside the EngineCore, where a hung EngineCore would stop the watchdog too and
        # outlive its node. With several GPUs, inside a placement group vLLM would pick its Ray
        # executor and ask Ray for more than the node's reserved slot.
        "distributed_executor_backend": "mp",
    }
    if lora_rank is not None:
        fits = [r for r in VLLM_LORA_RANKS if r >= lora_rank]
        if not fits:
            raise EngineUnavailable(
                f"trainer.lora.rank {lora_rank} is above the {VLLM_LORA_RANKS[-1]} vLLM serves"
            )
        kwargs.update(enable_lora=True, max_lora_rank=fits[0], max_loras=1)
    for name in ("max_model_len", "max_num_seqs"):  # unset: vLLM's defaults
        if getattr(config, name) is not None:
            kwargs[name] = getattr(config, name)
    return kwargs


def check_platform(device: str) -> None:
    from vllm.platforms import current_platform

    build = "cpu" if current_platform.is_cpu() else "cuda"
    if build != device:
        raise EngineUnavailable(
            f"rollout.engine.device is {device!r} but the installed vLLM is the {build} build: "
            f"set device: {build}, or install the other build"
        )


def check_cpu_head_size(model_dir: Path) -> None:
    """vLLM's CPU attention serves a fixed set of head sizes: refuse others before starting."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = list(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:  # another vLLM layout: let vLLM itself say
        return
    cfg = json.loads((model_dir / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if head not in supported:
        raise EngineUnavailable(
            f"{model_dir} has attention heads of size {head}; vLLM on CPU supports "
            f"{supported}. Use a model with such heads (`rollcall model init` builds the tiny "
            "model with head size 32; a tiny model built before 0.1 has 24: remove it and let "
            "the next run rebuild it), or engine kind 'hf'"
        )
