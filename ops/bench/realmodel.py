"""Sync against async with a real pretrained model: SmolLM2-135M-Instruct in its own chat
template with Hermes tool calls (``configs/smollm2.yaml``), the real GRPO trainer and the
``hf`` engine, on this machine's CPUs; ``--config configs/quickstart.yaml --model DIR`` runs the
tiny model's quickstart instead.

Each mode runs as its own ``rollcall quickstart --config`` job (embedded PostgreSQL, local
Ray) with the same overrides, and the figures come from the run directory's
``metrics.jsonl``: the training reward per step against trained samples (the learning curve),
the held-out reward at each evaluation (``run.eval`` of the config; ``--eval-every 0`` turns
it off), and over the steps after ``--warmup`` (start-up excluded) trained trajectories per
hour, the trainer's busy fraction, staleness and the speedup async/sync.

On a 2-core machine rollout and training share the same two cores, so async cannot overlap
them the way it does with separate devices.

Usage: python ops/bench/realmodel.py [--steps 12] [--warmup 2] [--home DIR] [overrides ...]
       (SmolLM2 is imported into the home once; the tiny model: --config configs/quickstart.yaml
       --model DIR, a folder from ``rollcall model init``)
Prints the curves and a table, then (last line) one JSON object with the figures.
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
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "rollcall.orchestrator.cli"]


def run_mode(
    mode: str, config: Path, model: Path | None, home: Path, steps: int, extra: list[str]
) -> Path:
    name = f"realmodel-{mode}"
    cmd = [
        *rollcall(), "--home", str(home), "quickstart", "--config", str(config),
        f"job.name={name}", f"run.mode={mode}", f"run.total_steps={steps}",
        *([f"model.path={model}"] if model is not None else []),
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
    evals = [r for r in records if r.get("kind") == "eval"]
    curve = [
        {
            "step": r["step"],
            "samples": r["trained_samples"],
            "reward": round(r["reward"], 4),
            "is_weight_mean": r.get("is_weight_mean"),
            "time": round(r["time"] - steps[0]["time"], 1),
        }
        for r in steps
    ]
    if len(steps) <= warmup + 1:
        raise SystemExit(f"{run_dir}: {len(steps)} steps, need more than warmup + 1")
    first, window = steps[warmup], steps[warmup + 1 :]
    span = window[-1]["time"] - first["time"]
    trained = window[-1]["trained_samples"] - first["trained_samples"]
    busy = sum(r["train_s"] + r["checkpoint_s"] + r["publish_s"] for r in window)
    return {
        "curve": curve,
        "held_out": [{"step": r["step"], "reward": r["reward"]} for r in evals],
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
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2.yaml")
    ap.add_argument("--model", type=Path, default=None, help="a model folder (model.path)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="steps before the measured window")
    ap.add_argument("--home", type=Path, default=None, help="default: a temporary folder")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    ap.add_argument("overrides", nargs="*", help="more dotted.key=value config overrides")
    args = ap.parse_args()
    home = args.home or Path(tempfile.mkdtemp(prefix="rc-realmodel-", dir="/tmp"))
    home.mkdir(parents=True, exist_ok=True)
    load_start = [round(x, 2) for x in os.getloadavg()]
    try:
        model = args.model.resolve() if args.model is not None else None
        runs = {
            mode: figures(
                run_mode(mode, args.config, model, home, args.steps, args.overrides), args.warmup
            )
            for mode in ("sync", "async")
        }
    finally:
        if args.home is None and not args.keep:
            # the embedded PostgreSQL was stopped by each job's CLI process
            shutil.rmtree(home, ignore_errors=True)
    for mode, r in runs.items():
        print(f"{mode}: training reward by step (trained samples, seconds since step 0)")
        for c in r["curve"]:
            print(f"  step {c['step']:3d}  {c['samples']:5d} samples  {c['time']:7.1f} s  "
                  f"reward {c['reward']:.3f}  is_weight_mean {c['is_weight_mean']}")  # fmt: skip
        for e in r["held_out"]:
            print(f"  held-out at step {e['step']}: {e['reward']}")
    print(f"{args.config.name}, {args.steps} steps (first {args.warmup + 1} excluded from the "
          f"table), {os.cpu_count()} CPUs")  # fmt: skip
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
        "config": str(args.config),
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
