"""Benchmark of rollout generation with the ``hf`` engine:

1. tokens/s with 1, 4 and 16 concurrent agent loops on one node (loops share the engine through
   dynamic batching); agent loops play the ``guess`` task for ``--turns`` turns of
   ``--tokens-per-turn`` tokens each;
2. per-turn latency of 10-turn trajectories (a long tool observation after every turn, so
   the context grows), with the KV cache reused across turns vs the context prefilled again:
   one trajectory alone, and 16 generated as one batch (batched KV reuse: every row starts
   from its own cached prefix), and the batch again with a KV store too small to hold it
   (evicted rows prefill again on their own first, the others keep their caches).

The model is the tiny local one (built into a temporary folder unless ``--model`` is given).

Usage: python ops/bench/rollout.py [--model DIR] [--loops 1 4 16] [--turns 6]
Prints a table, then (last line) one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollcall.tasks.guess import GuessSpec, GuessTask
from rollcall.workers.episode.chat import chat_for
from rollcall.workers.episode.engine import GenerationRequest
from rollcall.workers.episode.play import player
from rollcall.workers.episode.tools import ToolRunner
from rollcall.workers.episode.trajectory import Limits
from rollcall.workers.rollout.engines.batching import BatchingEngine
from rollcall.workers.rollout.engines.hf import HFEngine


def run_loops(hf: HFEngine, loops: int, turns: int, tokens_per_turn: int) -> dict[str, float]:
    engine = BatchingEngine(hf, max_batch=max(1, loops))
    task, spec = GuessTask(), GuessSpec(max_turns=turns, max_guesses=64)
    limits = Limits(max_turns=turns, max_tokens_per_turn=tokens_per_turn, max_tokens=100_000)
    generated = [0] * loops

    def one(i: int) -> None:
        with ToolRunner() as runner:
            chat = chat_for(hf.tokenizer)
            out = player(engine, chat, task, spec, task.prompt(spec, i), runner, limits).run()
            generated[i] = sum(out.trajectory.loss_mask)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(loops)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    batches, reqs = engine.batches, engine.batched_requests
    engine.close()
    return {
        "loops": loops,
        "tokens": sum(generated),
        "wall_s": wall,
        "tokens_per_s": sum(generated) / wall,
        "mean_batch": reqs / max(1, batches),
    }


def kv_turns(
    hf: HFEngine,
    turns: int,
    tokens_per_turn: int,
    reuse: bool,
    rows: int = 1,
    cap: int | None = None,
) -> list[float]:
    """Per-turn generate latency (s) of ``rows`` growing trajectories generated together;
    ``cap``: the KV store's token budget for this run (default: the engine's)."""
    hf.kv_reuse = reuse
    hf.kv.clear()
    default_cap = hf.kv.max_tokens
    hf.kv.max_tokens = cap or default_cap
    tok = hf.tokenizer
    ctxs = [
        list(tok.encode(f"<|system|>\nTools: search, open\n<|user|>\nFind {i}.\n<|assistant|>\n"))
        for i in range(rows)
    ]
    # about 200 tokens: ten turns stay inside the tiny model's 4,096 positions
    observation = list(tok.encode("\n<|tool|>\n" + "result line " * 24 + "\n<|assistant|>\n"))
    latencies = []
    for _ in range(turns):
        t0 = time.perf_counter()
        gens = hf.generate([GenerationRequest(c, tokens_per_turn, 1.0) for c in ctxs])
        latencies.append(time.perf_counter() - t0)
        for c, gen in zip(ctxs, gens, strict=True):
            c += gen.token_ids + observation
    hf.kv.max_tokens = default_cap
    hf.kv.clear()
    return latencies


SMALL_STORE = 16_384


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--loops", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--tokens-per-turn", type=int, default=48)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="rc-bench-model-") as tmp:
        model = args.model
        if model is None:
            from rollcall.workers.tiny_model import build_tiny

            model = build_tiny(Path(tmp) / "tiny")
        hf = HFEngine(model)
        params = sum(p.numel() for p in hf.model.parameters())
        run_loops(hf, 1, 1, 8)  # warm-up
        results = [run_loops(hf, n, args.turns, args.tokens_per_turn) for n in args.loops]
        kv_turns(hf, 2, 8, True)  # warm-up
        reuse = kv_turns(hf, 10, 32, True)
        prefill = kv_turns(hf, 10, 32, False)
        batch_reuse = kv_turns(hf, 10, 32, True, rows=16)
        batch_prefill = kv_turns(hf, 10, 32, False, rows=16)
        # a store too small for the batch (16 x ~2,300 tokens by the last turn): the least
        # recently used rows are evicted and prefill again, on their own (catch-up)
        catch_ups = hf.catch_ups
        batch_small = kv_turns(hf, 10, 32, True, rows=16, cap=SMALL_STORE)
        catch_ups = hf.catch_ups - catch_ups
        hf.kv_reuse = True
    print(
        f"# rollout benchmark: hf engine on CPU, {params / 1e6:.2f}M-parameter model, "
        f"{args.turns} turns"
    )
    print(f"{'loops':>5}  {'tokens/s':>9}  {'mean batch':>10}  {'tokens':>7}  {'wall s':>7}")
    for r in results:
        print(
            f"{r['loops']:>5}  {r['tokens_per_s']:>9.0f}  {r['mean_batch']:>10.1f}  "
            f"{r['tokens']:>7}  {r['wall_s']:>7.2f}"
        )
    print(
        f"10-turn trajectory, mean per-turn latency: KV reuse {1000 * sum(reuse) / 10:.1f} ms, "
        f"re-prefill {1000 * sum(prefill) / 10:.1f} ms; last turn {1000 * reuse[-1]:.1f} vs "
        f"{1000 * prefill[-1]:.1f} ms"
    )
    print(
        f"16 10-turn trajectories as one batch, mean per-turn latency: KV reuse "
        f"{1000 * sum(batch_reuse) / 10:.1f} ms, re-prefill {1000 * sum(batch_prefill) / 10:.1f} "
        f"ms; last turn {1000 * batch_reuse[-1]:.1f} vs {1000 * batch_prefill[-1]:.1f} ms"
    )
    print(
        f"the same with a {SMALL_STORE:,}-token KV store (rows evicted): mean "
        f"{1000 * sum(batch_small) / 10:.1f} ms, last turn {1000 * batch_small[-1]:.1f} ms, "
        f"{catch_ups} rows prefilled on their own"
    )
    for name, lat in (("kv reuse", batch_reuse), ("re-prefill", batch_prefill),
                      ("small store", batch_small)):  # fmt: skip
        print(f"  16-row per-turn ms, {name}: " + " ".join(f"{1000 * x:.0f}" for x in lat))
    print(
        json.dumps(
            {
                "bench": "rollout",
                "parameters": params,
                "turns": args.turns,
                "tokens_per_turn": args.tokens_per_turn,
                "tokens_per_s": {str(r["loops"]): round(r["tokens_per_s"], 1) for r in results},
                "mean_batch": {str(r["loops"]): round(r["mean_batch"], 2) for r in results},
                "turn_ms_kv_reuse": round(1000 * sum(reuse) / len(reuse), 2),
                "turn_ms_reprefill": round(1000 * sum(prefill) / len(prefill), 2),
                "last_turn_ms_kv_reuse": round(1000 * reuse[-1], 2),
                "last_turn_ms_reprefill": round(1000 * prefill[-1], 2),
                "batch16_turn_ms_kv_reuse": round(1000 * sum(batch_reuse) / 10, 2),
                "batch16_turn_ms_reprefill": round(1000 * sum(batch_prefill) / 10, 2),
                "batch16_last_turn_ms_kv_reuse": round(1000 * batch_reuse[-1], 2),
                "batch16_last_turn_ms_reprefill": round(1000 * batch_prefill[-1], 2),
                "batch16_turn_ms": {
                    "kv_reuse": [round(1000 * x, 1) for x in batch_reuse],
                    "reprefill": [round(1000 * x, 1) for x in batch_prefill],
                    "small_store": [round(1000 * x, 1) for x in batch_small],
                },
                "small_store_tokens": SMALL_STORE,
                "small_store_catch_ups": catch_ups,
            }
        )
    )


if __name__ == "__main__":
    main()
