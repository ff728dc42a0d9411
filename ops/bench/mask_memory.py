"""What a packed row's attention mask costs in SDPA on CPU: additive float against boolean.

A stack of ``--layers`` attention calls (SmolLM2-135M's heads: 9 query, 3 key/value, head size
64) on one row of ``--tokens`` tokens in four sequences, all with the same block-diagonal causal
mask, forward and backward, as the decoder layers of a packed micro-batch call it. Each
(mask, dtype) runs in its own process; the figure is the growth of its peak RSS over the calls
(the mask itself is built before and not counted).

A boolean mask is a quarter of a float32 one, but SDPA turns it into an additive mask of the
query's dtype inside every call, and autograd keeps each call's copy for backward: one mask per
layer instead of one shared mask.

Usage: python ops/bench/mask_memory.py [--tokens 4096] [--layers 6]
Prints one line per (mask, dtype).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ops.bench.memory import peak_rss

CASES = (
    ("float", "float32"),
    ("bool", "float32"),
    ("float", "bfloat16"),
    ("bool", "bfloat16"),
    ("float32", "bfloat16"),
)


def measure(kind: str, dtype_name: str, tokens: int, layers: int) -> str:
    import torch
    import torch.nn.functional as F

    from rollcall.workers.trainer.packing import pack

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    q = tokens // 4
    packed = pack([[1] * n for n in (q, q, q, tokens - 3 * q)])
    # "float": additive in the queries' dtype; "float32": additive in float32 (what the trainer
    # passes under FSDP2 bf16, the model's dtype being its float32 weights'); "bool": allowed
    additive = packed.attention_mask(torch.float32 if kind == "float32" else dtype)
    mask = additive == 0 if kind == "bool" else additive
    query = torch.randn(1, 9, tokens, 64, dtype=dtype, requires_grad=True)
    kv = torch.randn(1, 3, tokens, 64, dtype=dtype, requires_grad=True)
    base = peak_rss()
    start = time.perf_counter()
    h = query
    for _ in range(layers):
        h = h + F.scaled_dot_product_attention(h, kv, kv, attn_mask=mask, enable_gqa=True)
    h.float().sum().backward()
    peak = peak_rss()
    return (
        f"{kind:>7} mask, {dtype_name:<8}: peak +{(peak - base) / 2**20:,.0f} MiB over "
        f"{layers} layers, {time.perf_counter() - start:.1f} s (the mask: "
        f"{mask.numel() * mask.element_size() / 2**20:,.0f} MiB)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # a child: KIND DTYPE
    args = ap.parse_args()
    if args.one is not None:
        print(measure(args.one[0], args.one[1], args.tokens, args.layers))
        return
    for kind, dtype in CASES:
        cmd = [sys.executable, __file__, "--tokens", str(args.tokens),
               "--layers", str(args.layers), "--one", kind, dtype]  # fmt: skip
        print(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
