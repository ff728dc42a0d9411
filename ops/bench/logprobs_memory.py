"""Peak memory of the trainer's log-probs (with entropy), forward and backward, by chunk size.

A 2-layer, hidden-64 Qwen2 with Qwen's 151,936-token vocabulary (the head's logits dominate),
one packed row of ``--tokens`` tokens in four sequences, float32 on CPU. Each chunk size runs in
its own process; the figure is the growth of its peak RSS over the call.

Usage: python ops/bench/logprobs_memory.py [--tokens 2048] [--chunks 0 1024 256]
Prints one line per chunk size (0: the whole row at once).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ops.bench.memory import peak_rss

VOCAB = 151_936


def measure(tokens: int, chunk: int) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rollcall.workers.trainer.forward import token_logprobs
    from rollcall.workers.trainer.packing import pack

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * tokens,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).float()
    q = tokens // 4
    lengths = [q + 3, q - 5, q + 1, tokens - 3 * q + 1]
    packed = pack([torch.randint(0, VOCAB, (n,)).tolist() for n in lengths])
    base = peak_rss()
    start = time.perf_counter()
    logp, entropy = token_logprobs(
        model, packed, temperature=0.7, with_entropy=True, chunk_tokens=chunk
    )
    assert entropy is not None
    (logp.mean() + 0.01 * entropy.mean()).backward()
    peak = peak_rss()
    return (
        f"chunk {chunk:>6}: peak +{(peak - base) / 2**20:,.0f} MiB, "
        f"{time.perf_counter() - start:.1f} s (logits of the whole row: "
        f"{(packed.tokens - 1) * VOCAB * 4 / 2**20:,.0f} MiB)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 1024, 256])
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: one size
    args = ap.parse_args()
    if args.one is not None:
        print(measure(args.tokens, args.one))
        return
    for chunk in args.chunks:
        cmd = [sys.executable, __file__, "--tokens", str(args.tokens), "--one", str(chunk)]
        print(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
