"""Benchmark of a tool call's overhead at each ``rollout.tool_sandbox`` level, for a trivial
tool (``docs/security.md``):

- ``in-process``: an agent's tool without ``isolate`` (``ctx.tool``'s own path: the function
  on a thread of its own, awaited with its timeout), no process boundary;
- ``process``: the level ``process`` tool server (one long-lived process per runner);
- ``sandbox``: a fresh child per call (namespaces, limits, a working directory), without the
  network and with it (a task in ``network_tasks``: no network namespace to make).

Each as an agent's function (``call_function``) and, for the two tool-server levels and the
sandbox, as a plugin tool (the calculator's ``calc``, ``call``). ``--calls`` calls each after
``--warmup`` unmeasured ones, one at a time, ``--gap-ms`` apart (untimed: an agent loop
generates a turn between two calls, and the sandbox sets the next call up then; 0: back to
back); per call p50 and p95 in ms, and the CPU per call of this process and everything it
started (the tool servers, their zygotes and every call's processes), counted by a cgroup v1
``cpuacct`` group of the bench's own where one can be made (as root), so that the machine's
other work is not counted (kernel work done outside the group, e.g. a network namespace's
teardown, is not either).

Usage: python ops/bench/sandbox.py [--calls 300] [--warmup 20] [--gap-ms 20]
Prints a table, then (last line) one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
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


class CpuCounter:
    """CPU milliseconds of this process and its descendants, from a cgroup v1 ``cpuacct`` group
    this process moves into (None where none can be made)."""

    ROOT = Path("/sys/fs/cgroup/cpuacct")

    def __init__(self) -> None:
        self.group: Path | None = None
        try:
            group = self.ROOT / f"rollcall-bench-{os.getpid()}"
            group.mkdir()
            (group / "cgroup.procs").write_text(str(os.getpid()))
            self.group = group
        except OSError:
            self.group = None

    def ms(self) -> float | None:
        if self.group is None:
            return None
        return int((self.group / "cpuacct.usage").read_text()) / 1e6

    def close(self) -> None:
        if self.group is not None:
            with contextlib.suppress(OSError):
                (self.ROOT / "cgroup.procs").write_text(str(os.getpid()))
                self.group.rmdir()


def measure(
    call: Callable[[], Any], calls: int, warmup: int, gap_s: float, cpu: CpuCounter
) -> dict[str, float | None]:
    for _ in range(warmup):
        time.sleep(gap_s)
        call()
    took = []
    time.sleep(0.2)
    cpu0 = cpu.ms()
    for _ in range(calls):
        time.sleep(gap_s)
        t0 = time.perf_counter()
        call()
        took.append((time.perf_counter() - t0) * 1000)
    time.sleep(0.2)  # what the last call's processes do as they end
    cpu1 = cpu.ms()
    took.sort()
    return {
        "p50_ms": round(statistics.median(took), 3),
        "p95_ms": round(took[int(0.95 * (len(took) - 1))], 3),
        "cpu_ms": None if cpu0 is None or cpu1 is None else round((cpu1 - cpu0) / calls, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--gap-ms", type=float, default=20.0, help="untimed pause before each call")
    args = ap.parse_args()
    n, w, gap = args.calls, args.warmup, args.gap_ms / 1000
    cpu = CpuCounter()

    from rollcall.workers.episode.threads import bounded as _bounded

    t0 = time.perf_counter()
    protections = sandbox.probe()
    probe_ms = (time.perf_counter() - t0) * 1000
    print(protections.describe(sandbox.Limits()))
    print(f"probe: {probe_ms:.1f} ms (once per node process)")

    results: dict[str, dict[str, float | None]] = {}
    loop = asyncio.new_event_loop()
    results["in-process function"] = measure(
        lambda: loop.run_until_complete(_bounded(add, (), {"a": 1, "b": 2}, 5.0)), n, w, gap, cpu
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

            results[f"{label} function"] = measure(function, n, w, gap, cpu)
            results[f"{label} plugin tool"] = measure(tool, n, w, gap, cpu)

    cpu.close()
    print(f"\n{'per call':32} {'p50 ms':>9} {'p95 ms':>9} {'CPU ms':>9}   ({n} calls each, "
          f"{args.gap_ms:g} ms apart)")  # fmt: skip
    for label, r in results.items():
        cpu_ms = "-" if r["cpu_ms"] is None else f"{r['cpu_ms']:.2f}"
        print(f"{label:32} {r['p50_ms']:9.2f} {r['p95_ms']:9.2f} {cpu_ms:>9}")
    print(json.dumps({"calls": n, "gap_ms": args.gap_ms, "probe_ms": round(probe_ms, 1),
                      "load": os.getloadavg(), "results": results}))  # fmt: skip


if __name__ == "__main__":
    main()
