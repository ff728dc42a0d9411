"""Sync against async with the real thing: the tiny local model on the ``hf`` engine, the real
GRPO trainer, the built-in tasks of ``configs/quickstart.yaml``, on this machine's CPUs.

Each mode runs as its own ``rollcall quickstart`` job (embedded PostgreSQL, local Ray) with the
quickstart config and the same overrides, no held-out evaluation (it would share the CPUs), and
the figures come from the run directory's ``metrics.jsonl``: over the steps after ``--warmup``
(start-up excluded), trained trajectories per hour, the trainer's busy fraction (train,
checkpoint and publish time over wall time), staleness, and the speedup async/sync.

On a 2-core machine rollout and training share the same two cores, so async cannot overlap
them the way it does with separate devices: the speedup here is much smaller than the
pipeline benchmark's and says how much the pipelining alone recovers.

Usage: python ops/bench/realmodel.py --model DIR [--steps 16] [--warmup 3] [--home DIR]
       (DIR: a model from ``rollcall model init``; without --model one is built, about 6 min)
Prints a table, then (last line) one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def rollcall() -> list[str]:
    exe = Path(sys.executable).with_name("rollcall")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "orchestrator.cli"]


def run_mode(mode: str, model: Path, home: Path, steps: int, extra: list[str]) -> Path:
    name = f"realmodel-{mode}"
    cmd = [
        *rollcall(), "--home", str(home), "quickstart",
        f"job.name={name}", f"model.path={model}", f"run.mode={mode}",
        f"run.total_steps={steps}", "run.eval.every=0", "run.eval.episodes=0",
        *extra, "--no-live", "--json",
    ]  # fmt: skip
    t0 = time.monotonic()
    print(f"== {mode}: {' '.join(cmd[1:])}", flush=True)
    log = home / f"{name}.log"
    with log.open("w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if rc != 0:
        raise SystemExit(f"{mode} run failed (exit {rc}); see {log}")
    print(f"   {time.monotonic() - t0:.0f} s", flush=True)
    return home / "runs" / name


def figures(run_dir: Path, warmup: int) -> dict[str, Any]:
    records = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line
    ]
    steps = [r for r in records if r.get("kind") == "step"]
    if len(steps) <= warmup + 1:
        raise SystemExit(f"{run_dir}: {len(steps)} steps, need more than warmup + 1")
    first, window = steps[warmup], steps[warmup + 1 :]
    span = window[-1]["time"] - first["time"]
    trained = window[-1]["trained_samples"] - first["trained_samples"]
    busy = sum(r["train_s"] + r["checkpoint_s"] + r["publish_s"] for r in window)
    return {
        "window_steps": len(window),
        "window_s": round(span, 1),
        "trained": trained,
        "traj_per_h": trained / span * 3600,
        "busy": busy / span,
        "train_s_per_step": sum(r["train_s"] for r in window) / len(window),
        "step_s": span / len(window),
        "staleness_mean": sum(r["staleness_mean"] for r in window) / len(window),
        "staleness_max": max(r["staleness_max"] for r in window),
        "expired_groups": sum(_count(r.get("expired_groups", 0)) for r in window),
    }


def _count(v: Any) -> int:
    """A count, or the sum of a per-task dict of counts."""
    return sum(int(x) for x in v.values()) if isinstance(v, dict) else int(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a `rollcall model init` folder")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3, help="steps before the measured window")
    ap.add_argument("--home", type=Path, default=None, help="default: a temporary folder")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    ap.add_argument("overrides", nargs="*", help="more dotted.key=value config overrides")
    args = ap.parse_args()
    home = args.home or Path(tempfile.mkdtemp(prefix="rc-realmodel-", dir="/tmp"))
    home.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    load_start = [round(x, 2) for x in os.getloadavg()]
    try:
        model = args.model
        if model is None:
            model = home / "models" / "tiny"
            print(f"== building the tiny model in {model} (rollcall model init, about 6 min)")
            subprocess.check_call([*rollcall(), "model", "init", "--out", str(model)], cwd=ROOT)
        model = model.resolve()
        runs = {
            mode: figures(run_mode(mode, model, home, args.steps, args.overrides), args.warmup)
            for mode in ("sync", "async")
        }
    finally:
        if args.home is None and not args.keep:
            # the embedded PostgreSQL was stopped by each job's CLI process
            shutil.rmtree(home, ignore_errors=True)
    print(f"tiny model, configs/quickstart.yaml, {args.steps} steps (first {args.warmup + 1} "
          f"excluded), {os.cpu_count()} CPUs")  # fmt: skip
    print("mode | traj/h | step s | train s/step | busy | stale mean/max | expired groups")
    for mode, r in runs.items():
        print(
            f"{mode} | {r['traj_per_h']:,.0f} | {r['step_s']:.1f} | {r['train_s_per_step']:.1f} | "
            f"{r['busy']:.1%} | {r['staleness_mean']:.2f}/{r['staleness_max']:.0f} | "
            f"{r['expired_groups']}"
        )
    speedup = runs["async"]["traj_per_h"] / runs["sync"]["traj_per_h"]
    print(f"speedup async/sync: {speedup:.2f}x")
    out = {
        "benchmark": "realmodel",
        "steps": args.steps,
        "warmup": args.warmup,
        "overrides": args.overrides,
        "runs": runs,
        "speedup": speedup,
        "load_start": load_start,
        "load_end": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
