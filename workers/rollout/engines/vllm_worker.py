"""The side of the ``vllm`` engine that runs inside vLLM's worker processes
(``RollcallWorkerExtension``, mixed in through ``worker_extension_cls``): weights loaded in place
through vLLM's layer-wise reload, and the watchdog that kills the EngineCore once the process
that started vLLM is gone. Imported by vLLM's workers by its qualified name; vLLM, torch and
safetensors are imported only when called.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

from rollcall.orchestrator import procfs
from rollcall.workers import collective
from rollcall.workers.lora import write_adapter

WEIGHTS_FILE = "model.safetensors"  # what ``rollcall.workers.weights.publish`` writes


class RollcallWorkerExtension:
    """Mixed into each of vLLM's workers (``worker_extension_cls``, by qualified name) and called
    through ``collective_rpc``."""

    model_runner: Any
    vllm_config: Any

    def rollcall_load_weights(self, location: str) -> dict[str, int]:
        """Load a published version in place through vLLM's layer-wise reload; raise if any
        parameter was left unset."""
        from safetensors.torch import load_file

        state = load_file(str(Path(location) / WEIGHTS_FILE), device="cpu")
        return self._rollcall_load(state, location)

    def rollcall_receive_weights(
        self, offer: dict[str, Any], who: str, address: str, folder: str | None = None
    ) -> dict[str, Any]:
        """Collective transport: join the offer's group, receive the version whole into
        staging memory, then load it as ``rollcall_load_weights`` does. A broadcast that does
        not complete returns ``{"error": ...}`` with the model untouched; a load that fails
        raises (the engine's weights may then be half replaced).

        A LoRA version (the offer's ``adapter``) is not loaded here: its adapter is written to
        ``folder`` in peft's format, for the engine to load as a ``LoRARequest`` (vLLM 0.32
        loads an adapter from a path only). A write that fails is an ``error`` too."""
        o = collective.Offer.from_json(offer)
        device = "cuda" if o.backend == "nccl" else "cpu"
        try:
            state = collective.receive(o, device=device, who=who, address=address)
        except collective.BroadcastFailed as e:
            return {"error": str(e)}
        if o.adapter is not None:
            assert folder is not None, "a LoRA version needs the folder to write its adapter to"
            try:
                Path(folder).mkdir(parents=True, exist_ok=True)
                write_adapter({k: v.cpu() for k, v in state.items()}, Path(folder), o.adapter)
            except Exception as e:  # the node loads the version from its published file
                return {"error": f"writing the adapter of version {o.version}: {e}"}
            return {"error": None, "tensors": len(state)}
        return {"error": None, **self._rollcall_load(state, f"version {o.version} as received")}

    def _rollcall_load(self, state: dict[str, Any], where: str) -> dict[str, int]:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model_runner.get_model()
        expected = {name for name, _ in model.named_parameters()}
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            initialize_layerwise_reload(model)
            loaded = model.load_weights(iter(state.items()))
            finalize_layerwise_reload(model, self.vllm_config.model_config)
            lm_head = getattr(model, "lm_head", None)
            tied = getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False)
            method = getattr(lm_head, "quant_method", None)
            if tied and method is not None:  # CPU: the tied head's prepacked copy, made anew
                method.process_weights_after_loading(lm_head)
        missing = sorted(expected - set(loaded or ()))
        if missing:
            raise ValueError(f"{where}: {len(missing)} parameters were not in it: {missing[:5]}")
        return {"tensors": len(state), "parameters": len(expected)}

    def rollcall_watch(self, owner_pid: int, interval_s: float = 0.5) -> tuple[int, int]:
        """Start the watchdog: once the EngineCore is no longer a child of ``owner_pid`` (the
        process that started vLLM died), kill the EngineCore and exit. The worker is a process
        of its own under the EngineCore (the ``mp`` executor, which ``engine_kwargs`` always
        asks for) or, should vLLM run its ``uni`` executor, the EngineCore itself, whose
        parent is then the owner. Returns (the EngineCore's pid, this worker's pid); both the
        owner's when vLLM runs inside it (nothing to watch)."""
        me, parent = os.getpid(), os.getppid()
        if me == owner_pid:
            return me, me
        if parent == owner_pid:
            core = me  # uni: this is the EngineCore
        else:
            up = procfs.stat(parent)
            # mp: the parent is the EngineCore, a child of the owner unless the owner is
            # already gone (then the parent is still vLLM's process, not whoever adopted it)
            mp = up is not None and (up.ppid == owner_pid or up.name.startswith("VLLM"))
            core = parent if mp else me

        core_ident = procfs.identity(core)  # the EngineCore itself, not a later owner of its pid

        def watch() -> None:
            while True:
                time.sleep(interval_s)
                if procfs.parent_of(core) != owner_pid:
                    if core != me:
                        procfs.signal_same(core_ident, signal.SIGKILL)
                    # the engine's folder (inherited as VLLM_RPC_BASE_PATH): a SIGKILLed
                    # owner never closes its engine to remove it
                    remove_socket_dir(Path(os.environ.get("VLLM_RPC_BASE_PATH", "")))
                    os._exit(1)

        threading.Thread(target=watch, name="rollcall-watchdog", daemon=True).start()
        return core, me


def remove_socket_dir(path: Path) -> None:
    """Remove one engine's socket folder (``vllm_start.socket_dir``): when its engine closes
    or fails to start, or from the EngineCore's watchdog once its owner is gone. Only a folder
    ``socket_dir`` makes, never vLLM's default (the temp folder itself)."""
    if path.parent.name.startswith("rollcall-vllm-") or path.name.startswith("rollcall-vllm-"):
        shutil.rmtree(path, ignore_errors=True)
