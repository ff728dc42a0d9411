"""LoRA adapters (``trainer.lora``, peft): injected into the trainer's model, published alone by
version in peft's own format, applied by the engines, merged for the final policy.

The trainer injects the adapters into its transformers model in place
(``peft.inject_adapter_in_model``: the model stays a ``Qwen2ForCausalLM``, whose targeted
``Linear`` layers become peft ``LoraLayer``s with ``base_layer``, ``lora_A`` and ``lora_B``), so
its forward, packing and sharding are those of full fine-tuning; only the adapter parameters
require gradients and get optimizer state. A published version is a folder holding
``adapter_model.safetensors`` and ``adapter_config.json`` exactly as ``PeftModel.save_pretrained``
writes them: keys ``base_model.model.<module>.lora_A.weight``, which vLLM's ``LoRARequest`` and
peft's loaders read. The ``hf`` engine injects the same adapters into its model at the first
adapter it loads and copies each version's tensors in; vLLM loads each version as a LoRA
adapter of its own (``rollcall.workers.rollout.engines.vllm``). The base weights never move.

Merging (the final policy in transformers format) is W + (alpha / r) B A for every adapted
layer, peft's own formula for ``Linear`` LoRA layers without rsLoRA or DoRA.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollcall.orchestrator.config import LoRAConfig

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_NAME = "default"  # the adapter's name inside the model (peft's default)
FILE_PREFIX = "base_model.model."  # peft's saved keys: the PeftModel's path to the model


def peft_config(lora: LoRAConfig, base_model: str | None = None) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )


def linear_names(model: Any) -> set[str]:
    """The last name of every ``Linear`` module of ``model`` (what ``target_modules`` match)."""
    import torch

    return {
        n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    }


def check_targets(model_dir: str | Path, targets: list[str]) -> None:
    """Raise ``ValueError`` in one sentence when a target module is not a linear layer of the
    model at ``model_dir`` (built on the meta device: no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = linear_names(model)
    missing = [t for t in targets if t not in names]
    if missing:
        raise ValueError(
            f"trainer.lora.target_modules {missing} are not linear layers of {model_dir}; "
            f"it has {sorted(n for n in names if n != 'lm_head')}"
        )


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def inject(model: Any, lora: LoRAConfig) -> int:
    """Inject ``lora``'s adapters into ``model`` in place and freeze everything else; returns
    the number of trainable parameters. ``lora_B`` starts at zero: the model's output is the
    base model's until the adapters train."""
    from peft import inject_adapter_in_model

    missing = [t for t in lora.target_modules if t not in linear_names(model)]
    if missing:
        raise ValueError(f"trainer.lora.target_modules {missing} are not linear layers")
    inject_adapter_in_model(peft_config(lora), model, adapter_name=ADAPTER_NAME)
    trainable = 0
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_param(name))
        trainable += p.numel() if p.requires_grad else 0
    return trainable


def file_key(name: str) -> str:
    """A model parameter's name as peft saves it (adapter name dropped, PeftModel prefix)."""
    for ab in ("lora_A", "lora_B"):
        name = name.replace(f".{ab}.{ADAPTER_NAME}.", f".{ab}.")
    return FILE_PREFIX + name


def param_key(key: str) -> str:
    """``file_key``'s inverse."""
    name = key.removeprefix(FILE_PREFIX)
    for ab in ("lora_A", "lora_B"):
        name = name.replace(f".{ab}.", f".{ab}.{ADAPTER_NAME}.")
    return name


def is_adapter(location: str | Path) -> bool:
    return (Path(location) / ADAPTER_FILE).is_file()


def write_adapter(
    state: dict[str, Any],
    directory: Path,
    config: dict[str, Any],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write an adapter (model parameter names -> tensors) and its peft config (``config``, a
    ``LoraConfig.to_dict()``) into ``directory`` as ``PeftModel.save_pretrained`` does."""
    from safetensors.torch import save_file

    save_file(
        {file_key(k): v.contiguous() for k, v in state.items()},
        str(directory / ADAPTER_FILE),
        metadata={"format": "pt", **(metadata or {})},
    )
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, default=list))


def config_dict(lora: LoRAConfig, base_model: str | None = None) -> dict[str, Any]:
    """The adapter's ``adapter_config.json`` contents (peft's ``LoraConfig.to_dict()``)."""
    d: dict[str, Any] = peft_config(lora, base_model).to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in d.items()}


def read_adapter(location: str | Path) -> dict[str, Any]:
    """A published adapter's tensors, by model parameter name."""
    from safetensors.torch import load_file

    return {param_key(k): v for k, v in load_file(str(Path(location) / ADAPTER_FILE)).items()}


def read_config(location: str | Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((Path(location) / ADAPTER_CONFIG).read_text())
    return data


def load_adapter(model: Any, location: str | Path, where: str) -> None:
    """Copy a published adapter into ``model`` (``apply_adapter``)."""
    apply_adapter(model, read_adapter(location), read_config(location), where)


def apply_adapter(model: Any, state: dict[str, Any], config: dict[str, Any], where: str) -> None:
    """Copy an adapter (``state``: model parameter names -> tensors; ``config``: its
    ``adapter_config.json``) into ``model``, injected with that config at the first call.
    Raises ``ValueError`` naming the keys when the adapter does not fit, before changing
    anything."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model

    targets = {n: p for n, p in model.named_parameters() if is_adapter_param(n)}
    if not targets:
        inject_adapter_in_model(
            LoraConfig.from_peft_type(**config), model, adapter_name=ADAPTER_NAME
        )
        model.requires_grad_(False)
        targets = {n: p for n, p in model.named_parameters() if is_adapter_param(n)}
    unexpected = sorted(set(state) - set(targets))
    missing = sorted(set(targets) - set(state))
    if unexpected or missing:
        raise ValueError(f"{where} does not fit the model's adapters: {(unexpected + missing)[:5]}")
    with torch.no_grad():
        for name, src in state.items():
            targets[name].copy_(src)


def merged_state_dict(state: dict[str, Any], scale: float) -> dict[str, Any]:
    """A full state dict of an injected model (``base_layer`` and adapter keys) as the plain
    model's: each adapted layer's weight W + scale B A, its adapter tensors dropped."""
    out: dict[str, Any] = {}
    for name, value in state.items():
        if is_adapter_param(name):
            continue
        if ".base_layer." not in name:
            out[name] = value
            continue
        layer, _, leaf = name.partition(".base_layer.")
        if leaf == "weight":
            a = state[f"{layer}.lora_A.{ADAPTER_NAME}.weight"].float()
            b = state[f"{layer}.lora_B.{ADAPTER_NAME}.weight"].float()
            value = (value.float() + scale * (b @ a)).to(value.dtype)
        out[f"{layer}.{leaf}"] = value
    return out
