"""Benchmark of sequence packing on a long-tail trajectory-length mix.

1. Token slots: ``--sequences`` lengths drawn log-uniformly between 800 and 12,000 tokens (the
   chapter's long-tail example). Padded: micro-batches of ``--padded-batch`` sequences in arrival
   order, each padded to its longest sequence. Packed: first-fit-decreasing bins of
   ``--budget`` tokens, each row exactly its tokens (and, for static shapes, padded to the
   budget). Fraction saved = 1 - packed / padded.
2. Time: forward + backward of the tiny local model on CPU over the same mix scaled down by
   ``--scale`` (a 12,000-token row's attention does not fit a laptop's memory in fp32 eager),
   packed (block-diagonal mask) vs padded (2-D padding mask), same loss on the same tokens.

Usage: python ops/bench/packing.py [--model DIR] [--sequences 256] [--scale 8]
Prints a table, then (last line) one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollcall.workers.trainer.packing import first_fit_decreasing, padded_slots

MIN_TOKENS, MAX_TOKENS = 800, 12_000


def long_tail(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    lo, hi = math.log(MIN_TOKENS), math.log(MAX_TOKENS)
    return [round(math.exp(rng.uniform(lo, hi))) for _ in range(n)]


def slots(lengths: list[int], budget: int, padded_batch: int) -> dict[str, float]:
    chunks = [
        list(range(i, min(i + padded_batch, len(lengths))))
        for i in range(0, len(lengths), padded_batch)
    ]
    padded = padded_slots(lengths, chunks)
    bins = first_fit_decreasing(lengths, budget)
    packed = sum(lengths)
    packed_static = len(bins) * budget
    return {
        "tokens": packed,
        "padded_slots": padded,
        "packed_slots": packed,
        "packed_static_slots": packed_static,
        "bins": len(bins),
        "saved_frac": 1 - packed / padded,
        "saved_frac_static": 1 - packed_static / padded,
    }


def fwd_bwd_times(
    model: Any, lengths: list[int], budget: int, padded_batch: int, repeats: int
) -> dict[str, float]:
    import torch

    from rollcall.workers.trainer.forward import token_logprobs
    from rollcall.workers.trainer.packing import pack

    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]

    def packed_pass() -> None:
        for b in first_fit_decreasing(lengths, budget):
            logp, _ = token_logprobs(model, pack([seqs[i] for i in b]))
            (-logp.sum()).backward()

    def padded_pass() -> None:
        for i in range(0, len(seqs), padded_batch):
            chunk = seqs[i : i + padded_batch]
            width = max(len(s) for s in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)  # [B, T]
            attn = torch.zeros((len(chunk), width), dtype=torch.long)  # [B, T]
            for r, s in enumerate(chunk):
                ids[r, : len(s)] = torch.tensor(s)
                attn[r, : len(s)] = 1
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]  # [B, T-1]
            (-(lp * attn[:, 1:]).sum()).backward()

    out = {}
    for name, fn in (("packed", packed_pass), ("padded", padded_pass)):
        fn()  # warm-up
        t0 = time.perf_counter()
        for _ in range(repeats):
            model.zero_grad()
            fn()
        out[f"{name}_s"] = (time.perf_counter() - t0) / repeats
    out["speedup"] = out["padded_s"] / out["packed_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--budget", type=int, default=16_384, help="packed micro-batch tokens")
    ap.add_argument("--padded-batch", type=int, default=4, help="sequences per padded batch")
    ap.add_argument("--scale", type=int, default=8, help="length divisor for the timing part")
    ap.add_argument("--timed-sequences", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    lengths = long_tail(args.sequences, args.seed)
    s = slots(lengths, args.budget, args.padded_batch)
    print(
        f"{args.sequences} sequences, {MIN_TOKENS}-{MAX_TOKENS} tokens (log-uniform), "
        f"mean {s['tokens'] / args.sequences:.0f}"
    )
    print(f"{'layout':<28} {'token slots':>12} {'saved':>7}")
    print(f"{f'padded (batches of {args.padded_batch})':<28} {s['padded_slots']:>12,}")
    print(f"{'packed (exact rows)':<28} {s['packed_slots']:>12,} {s['saved_frac']:>7.1%}")
    print(
        f"{f'packed (rows of {args.budget})':<28} {s['packed_static_slots']:>12,} "
        f"{s['saved_frac_static']:>7.1%}"
    )

    import torch
    from transformers import AutoModelForCausalLM

    from rollcall.workers.tiny_model import build_tiny

    model_dir = args.model or build_tiny(Path(tempfile.mkdtemp(prefix="rollcall-bench-")))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    timed = [max(2, n // args.scale) for n in lengths[: args.timed_sequences]]
    t = fwd_bwd_times(model, timed, args.budget // args.scale, args.padded_batch, args.repeats)
    print(
        f"forward+backward, tiny model, {len(timed)} sequences of {min(timed)}-{max(timed)} "
        f"tokens (lengths / {args.scale}): packed {t['packed_s']:.2f} s, "
        f"padded {t['padded_s']:.2f} s, speedup {t['speedup']:.2f}x"
    )
    print(
        json.dumps(
            {
                "sequences": args.sequences,
                "budget": args.budget,
                **{k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()},
                "timed_sequences": len(timed),
                "scale": args.scale,
                **{f"fwd_bwd_{k}": round(v, 4) for k, v in t.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
