"""LoRA against full fine-tuning, per model: the parameters that train, the optimizer state they
carry (AdamW's two moments, measured after one real step), the bytes one published version
takes (the weights file, or the adapter alone), and the time an engine takes to load a version
(the ``hf`` engine: ``load_into`` of the weights file, or ``load_adapter``; with ``--vllm``,
vLLM's layer-wise reload, or ``add_lora`` of the adapter).

Usage: python ops/bench/lora.py [--models tiny,smollm2] [--rank 8] [--vllm]
(``smollm2`` is ROLLCALL_HOME/models/smollm2-135m: ``rollcall model import smollm2``.)
Prints one row per model and mode, then (last line) one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollcall.orchestrator.config import LoRAConfig
from rollcall.workers import lora as adapters
from rollcall.workers.weights import publish, publish_adapter, weights_file


def _model_dir(name: str) -> Path:
    home = Path(os.environ.get("ROLLCALL_HOME", Path.home() / ".rollcall"))
    folder = {"tiny": "tiny", "smollm2": "smollm2-135m"}.get(name, name)
    path = home / "models" / folder
    if not (path / "config.json").is_file():
        raise SystemExit(f"{path}: no model (rollcall model init / rollcall model import smollm2)")
    return path


def _publish(model_dir: Path, lora: LoRAConfig | None, root: Path) -> tuple[Any, str, int]:
    """One optimizer step of the model (full or LoRA), then a published version: (the trained
    model, the version's folder, optimizer bytes)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if lora is not None:
        adapters.inject(model, lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    ids = torch.arange(3, 67)[None]
    out = model(ids, labels=ids)
    out.loss.backward()
    opt.step()
    optimizer_bytes = sum(
        t.numel() * t.element_size()
        for state in opt.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    if lora is None:
        sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        location = publish(sd, root, 1)
    else:
        state = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        location = publish_adapter(state, adapters.config_dict(lora, str(model_dir)), root, 1)
    return model, location, optimizer_bytes


def _load_s(engine: Any, location: str, repeats: int = 3) -> float:
    """The median time ``engine`` takes to load the version at ``location``."""
    times = []
    for v in range(1, repeats + 1):
        t0 = time.perf_counter()
        engine.load_weights(v, location)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _hf_load_s(model_dir: Path, location: str) -> float:
    from rollcall.workers.rollout.engines.hf import HFEngine

    return _load_s(HFEngine(str(model_dir), seed=0), location)


def _vllm_load_s(model_dir: Path, location: str, lora: LoRAConfig | None) -> float:
    from rollcall.orchestrator.config import VLLMEngineConfig
    from rollcall.workers.rollout.engines.vllm import VLLMEngine

    engine = VLLMEngine(
        model_dir,
        VLLMEngineConfig(device="cpu", dtype="float32"),
        lora_rank=lora.rank if lora is not None else None,
    )
    try:
        return _load_s(engine, location)
    finally:
        engine.close()


def measure(name: str, rank: int, with_vllm: bool) -> list[dict[str, Any]]:
    model_dir = _model_dir(name)
    rows = []
    for mode in ("full", "lora"):
        lora = LoRAConfig(rank=rank, alpha=2 * rank) if mode == "lora" else None
        with tempfile.TemporaryDirectory() as tmp:
            model, location, opt_bytes = _publish(model_dir, lora, Path(tmp))
            row: dict[str, Any] = {
                "model": name,
                "mode": mode if lora is None else f"lora r{rank}",
                "parameters": sum(p.numel() for p in model.parameters()),
                "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "optimizer_bytes": opt_bytes,
                "publish_bytes": sum(p.stat().st_size for p in Path(location).iterdir()),
                "file": weights_file(location).name,
                "hf_load_s": _hf_load_s(model_dir, location),
            }
            if with_vllm:
                row["vllm_load_s"] = _vllm_load_s(model_dir, location, lora)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--vllm", action="store_true", help="also time vLLM's loads (CPU build)")
    args = ap.parse_args()
    rows = [r for name in args.models.split(",") for r in measure(name, args.rank, args.vllm)]
    head = f"{'model':<8} {'mode':<8} {'trainable':>11} {'optimizer':>11} {'publish':>11}"
    print(head + f" {'hf load':>9}" + (f" {'vLLM load':>10}" if args.vllm else ""))
    for r in rows:
        line = (
            f"{r['model']:<8} {r['mode']:<8} {r['trainable']:>11,} "
            f"{r['optimizer_bytes'] / 2**20:>9.2f}MB {r['publish_bytes'] / 2**20:>9.2f}MB "
            f"{r['hf_load_s'] * 1e3:>7.1f}ms"
        )
        if "vllm_load_s" in r:
            line += f" {r['vllm_load_s'] * 1e3:>8.1f}ms"
        print(line)
    print(json.dumps({"rank": args.rank, "rows": rows}))


if __name__ == "__main__":
    main()
