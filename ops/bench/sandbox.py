"""Benchmark of a tool call's overhead at each ``rollout.tool_sandbox`` level, for a trivial
tool (``docs/security.md``):

- ``in-process``: an agent's tool without ``isolate`` (``ctx.tool``'s own path: the function
  on a thread of its own, awaited with its timeout), no process boundary;
- ``process``: the level ``process`` tool server (one long-lived process per runner);
- ``sandbox``: a fresh child per call (namespaces, limits, a working directory), without the
  network and with it (a task in ``network_tasks``: no network namespace to make).

Each as an agent's function (``call_function``) and, for the two tool-server levels and the
sandbox, as a plugin tool (the calculator's ``calc``, ``call``). ``--calls`` calls each after
``--warmup`` unmeasured ones, one at a time; per call p50 and p95 in ms.

Usage: python ops/bench/sandbox.py [--calls 300] [--warmup 20]
Prints a table, then (last line) one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollcall.orchestrator.config import ToolSandboxConfig
from rollcall.tasks.calculator import CalculatorSpec, CalculatorTask
from rollcall.workers.episode import sandbox
from rollcall.workers.episode.tools import ToolRunner


def add(a: int, b: int) -> int:
    return a + b


def measure(call: Callable[[], Any], calls: int, warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        call()
    took = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        took.append((time.perf_counter() - t0) * 1000)
    took.sort()
    return {
        "p50_ms": round(statistics.median(took), 3),
        "p95_ms": round(took[int(0.95 * (len(took) - 1))], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    n, w = args.calls, args.warmup

    from rollcall.workers.episode.threads import bounded as _bounded

    t0 = time.perf_counter()
    protections = sandbox.probe()
    probe_ms = (time.perf_counter() - t0) * 1000
    print(protections.describe(sandbox.Limits()))
    print(f"probe: {probe_ms:.1f} ms (once per node process)")

    results: dict[str, dict[str, float]] = {}
    loop = asyncio.new_event_loop()
    results["in-process function"] = measure(
        lambda: loop.run_until_complete(_bounded(add, (), {"a": 1, "b": 2}, 5.0)), n, w
    )
    loop.close()
    task, spec = CalculatorTask(), CalculatorSpec()
    for label, config, network in (
        ("process", ToolSandboxConfig(level="process"), False),
        ("sandbox", ToolSandboxConfig(), False),
        ("sandbox + network", ToolSandboxConfig(), True),
    ):
        with ToolRunner(timeout_s=10, sandbox=config) as runner:

            def function(r: ToolRunner = runner, net: bool = network) -> None:
                ok, value = r.call_function(add, (1, 2), {}, timeout_s=10, network=net)
                assert ok and value == 3, value

            def tool(r: ToolRunner = runner, net: bool = network) -> None:
                res = r.call(task, spec, {"answer": "1"}, {}, "calc", {"expression": "6 * 7"},
                             network=net)  # fmt: skip
                assert res.observation == "42", res.observation

            results[f"{label} function"] = measure(function, n, w)
            results[f"{label} plugin tool"] = measure(tool, n, w)

    print(f"\n{'per call':32} {'p50 ms':>9} {'p95 ms':>9}   ({n} calls each)")
    for label, r in results.items():
        print(f"{label:32} {r['p50_ms']:9.2f} {r['p95_ms']:9.2f}")
    print(json.dumps({"calls": n, "probe_ms": round(probe_ms, 1), "results": results}))


if __name__ == "__main__":
    main()
