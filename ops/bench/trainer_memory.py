"""Peak memory and time of one trainer step on SmolLM2-135M-Instruct, by micro-batch size.

The real trainer rank (``rollcall.workers.trainer.rank.TrainerRank``: FSDP2 over one CPU process,
the
chunked log-probs of ``rollcall.workers.trainer.forward``, the GRPO loss, gradient clipping, AdamW)
runs one step of one packed micro-batch of ``--tokens`` tokens (sequences of 512-1,536 tokens, at
most the model's 8,192 positions), in two set-ups:

- ``before``: float32, whole-row log-probs (``trainer.logprob_chunk_tokens 0``), no activation
  checkpointing;
- ``after``: bf16 (FSDP2 mixed precision over float32 weights), log-probs in chunks of 1,024
  positions, activation checkpointing.

Each (set-up, size) runs in its own process; the figures are that process's peak RSS over the
whole run, its RSS once the rank is set up (weights, before the step: AdamW's state and the
gradients come in the step), and the step's wall time. The dense block-diagonal mask of
``PackedBatch.attention_mask`` (``[T, T]`` in the model's dtype, float32 under FSDP2 either way)
is reported on its own. A process whose RSS passes ``--cap-gib``, or that leaves the machine
less than 1 GiB available, is killed and reported as "did not fit", so the machine's OOM killer
never picks a victim.

On a CUDA device (``--device cuda``; ``ops/gpu/trainer_memory.py`` runs it there) the rank
computes on the GPU and each row also has the device's peak memory (``cuda_peak_gib``:
``torch.cuda.max_memory_allocated``, and ``cuda_reserved_gib``: what the caching allocator
held at its peak); a step that runs out of device memory is "did not fit".

Usage: python ops/bench/trainer_memory.py [--model DIR] [--tokens 2048 8192 16384]
       [--setups before after] [--threads 2] [--cap-gib G] [--timeout-s S] [--device cuda]
       (DIR: from ``rollcall model import smollm2``; without --model one is imported into a
       temporary directory, about a minute)
Prints a table, then (last line) one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ops.bench.memory import GIB, available, peak_rss, rss, run_child

SETUPS: dict[str, dict[str, Any]] = {  # RankSettings fields (trainer.* of the config)
    "before": dict(precision="float32", logprob_chunk_tokens=0, activation_checkpointing=False),
    "after": dict(precision="bf16", logprob_chunk_tokens=1024, activation_checkpointing=True),
}


def sequence_lengths(tokens: int, seed: int = 0) -> list[int]:
    """Lengths of 512-1,536 tokens that add up to ``tokens``."""
    import random

    rng = random.Random(seed)
    lengths: list[int] = []
    left = tokens
    while left > 1536:
        n = rng.randint(512, 1536)
        lengths.append(n)
        left -= n
    lengths.append(left)
    return lengths


def measure(
    model_dir: str, setup: str, tokens: int, threads: int, device: str = "cpu"
) -> dict[str, Any]:
    """One step in this process (the child)."""
    import numpy as np
    import torch

    from rollcall.orchestrator.algorithms import LossConfig
    from rollcall.workers.trainer.batch import TrainSequence
    from rollcall.workers.trainer.rank import RankSettings, TrainerRank

    settings = RankSettings(
        model_dir=model_dir,
        lr=1e-6,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        warmup_updates=0,
        total_updates=1,
        schedule="constant",
        min_lr_ratio=0.0,
        grad_clip=1.0,
        loss=LossConfig(),
        threads=threads,
        device=device,
        **SETUPS[setup],
    )
    rank = TrainerRank(0, 1, settings)
    rank.setup(rank.address())
    vocab = int(rank.model.config.vocab_size)
    gen = np.random.default_rng(0)
    micro = []
    for i, n in enumerate(sequence_lengths(tokens)):
        mask = np.zeros(n, np.uint8)
        mask[n // 4 :] = 1  # a quarter prompt, the rest generated
        micro.append(
            TrainSequence(
                token_ids=gen.integers(3, vocab, n).astype(np.int32),
                loss_mask=mask,
                behaviour_logprobs=np.full(n, -2.0, np.float32),
                advantage=1.0 if i % 2 else -1.0,
                scale=1.0 / tokens,
                task="bench",
            )
        )
    mask_dtype = rank.model.dtype  # what model_inputs builds the mask in
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    set_up = rss()
    start = time.perf_counter()
    out = rank.train([[micro]])
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = peak_rss()
    assert np.isfinite(out["loss"]), out
    on_device = (
        {
            "cuda_peak_gib": round(torch.cuda.max_memory_allocated() / GIB, 2),
            "cuda_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 2),
        }
        if cuda
        else {}
    )
    return {
        **on_device,
        "setup": setup,
        "tokens": tokens,
        "sequences": len(micro),
        "fit": True,
        "peak_gib": round(peak / GIB, 2),
        "set_up_gib": round(set_up / GIB, 2),
        "step_s": round(seconds, 1),
        "mask_mib": round(tokens * tokens * torch.finfo(mask_dtype).bits / 8 / 2**20),
        "mask_dtype": str(mask_dtype).removeprefix("torch."),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="SmolLM2 folder (default: import one)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--setups", nargs="+", choices=sorted(SETUPS), default=["before", "after"])
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the rank")
    ap.add_argument("--device", default="cpu", help="the rank's device: cpu or cuda")
    ap.add_argument(
        "--cap-gib", type=float, help="RSS at which a child is killed (default: available - 3)"
    )
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="per configuration")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # a child: SETUP TOKENS
    args = ap.parse_args()
    if args.one is not None:
        try:
            result = measure(
                str(args.model), args.one[0], int(args.one[1]), args.threads, args.device
            )
        except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
            text = str(e).lower()
            if (
                not isinstance(e, MemoryError)
                and "alloc" not in text
                and "out of memory" not in text
            ):
                raise
            result = {"setup": args.one[0], "tokens": int(args.one[1]), "fit": False,
                      "why": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}  # fmt: skip
        print(json.dumps(result), flush=True)
        return

    tmp = None
    model = args.model
    if model is None:
        from rollcall.workers.realmodel import import_smollm2

        tmp = Path(tempfile.mkdtemp(prefix="smollm2-"))
        model = import_smollm2(tmp / "smollm2-135m", log=print)
    cap = int(args.cap_gib * GIB) if args.cap_gib else available() - 3 * GIB
    load_start = os.getloadavg()[0]
    rows: list[dict[str, Any]] = []
    try:
        for tokens in args.tokens:
            for setup in args.setups:
                cmd = [sys.executable, __file__, "--model", str(model), "--device", args.device,
                       "--threads", str(args.threads), "--one", setup, str(tokens)]  # fmt: skip
                print(f"== {setup} {tokens} tokens", flush=True)
                child = run_child(cmd, cap=cap, timeout_s=args.timeout_s)
                lines = [ln for ln in child.stdout.splitlines() if ln.startswith("{")]
                if child.returncode == 0 and lines:
                    row = json.loads(lines[-1])
                else:
                    why = (
                        f"RSS passed {cap / GIB:.1f} GiB or the machine's available memory "
                        f"fell under 1 GiB (RSS reached {child.max_rss / GIB:.1f} GiB)"
                        if child.over_cap
                        else f"ran past {args.timeout_s:.0f} s"
                        if child.timed_out
                        else f"exit {child.returncode}"
                    )
                    row = {"setup": setup, "tokens": tokens, "fit": False, "why": why,
                           "max_rss_gib": round(child.max_rss / GIB, 2)}  # fmt: skip
                    if child.returncode < 0 and not child.over_cap and not child.timed_out:
                        row["why"] = f"killed by signal {-child.returncode} (out of memory?)"
                rows.append(row)
                print(f"   {json.dumps(row)}", flush=True)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    print()
    gpu = " device peak" if args.device != "cpu" else ""
    print(f"{'setup':<7} {'tokens':>7} {'peak':>10} {'set up':>8} {'step':>8} {'mask':>14}{gpu}")
    for r in rows:
        if r["fit"]:
            print(
                f"{r['setup']:<7} {r['tokens']:>7,} {r['peak_gib']:>6.2f} GiB "
                f"{r['set_up_gib']:>4.2f} GiB {r['step_s']:>6.1f} s "
                f"{r['mask_mib']:>6,} MiB {r['mask_dtype']}"
                + (f" {r['cuda_peak_gib']:>6.2f} GiB" if "cuda_peak_gib" in r else "")
            )
        else:
            verdict = "did not finish" if r["why"].startswith("ran past") else "did not fit"
            print(f"{r['setup']:<7} {r['tokens']:>7,} {verdict} ({r['why']})")
    print(
        json.dumps(
            {
                "rows": rows,
                "cap_gib": round(cap / GIB, 1),
                "threads": args.threads,
                "device": args.device,
                "load_start": round(load_start, 2),
                "load_end": round(os.getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
