"""Learning curves of finished runs, side by side: held-out reward per task against trained
samples and wall time, from each run directory's ``metrics.jsonl``.

    python ops/bench/learning.py RUN_DIR [RUN_DIR ...] [--png curves.png]

Typical use: the quickstart in ``async`` and in ``sync`` mode (same config otherwise), to see
whether async reaches sync's reward at equal trained samples, and how much sooner. Prints a
table per run and, as its last line, one JSON object: per run and task the first and last
held-out reward, the gain, trained samples and seconds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml


def curve(run_dir: Path) -> dict[str, Any]:
    """Eval points of one run: step, trained samples, seconds since the first record, reward."""
    records = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line
    ]
    if not records:
        raise SystemExit(f"{run_dir}: no metrics")
    t0 = records[0]["time"]
    samples = {0: 0}
    seconds = {0: 0.0}
    for r in records:
        if r.get("kind") == "step":  # an eval at step s evaluates policy version s
            samples[r["policy_version"]] = r["trained_samples"]
            seconds[r["policy_version"]] = r["time"] - t0
    points = [
        {
            "step": r["step"],
            "samples": samples.get(r["step"], 0),
            "seconds": round(seconds.get(r["step"], r["time"] - t0), 1),
            "reward": r["reward"],
        }
        for r in records
        if r.get("kind") == "eval"
    ]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    return {"run": str(run_dir), "mode": config["run"]["mode"], "points": points}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--png", type=Path, default=None, help="write the curves here")
    args = ap.parse_args()
    curves = [curve(r) for r in args.runs]
    summary: dict[str, Any] = {}
    for c in curves:
        tasks = sorted({t for p in c["points"] for t in p["reward"]})
        print(f"\n{c['run']} ({c['mode']})")
        print(f"{'step':>5} {'samples':>8} {'seconds':>8} " + " ".join(f"{t:>11}" for t in tasks))
        for p in c["points"]:
            cells = " ".join(f"{p['reward'].get(t, float('nan')):>11.3f}" for t in tasks)
            print(f"{p['step']:>5} {p['samples']:>8} {p['seconds']:>8.0f} {cells}")
        first, last = c["points"][0], c["points"][-1]
        summary[c["run"]] = {
            "mode": c["mode"],
            "samples": last["samples"],
            "seconds": last["seconds"],
            "tasks": {
                t: {
                    "first": round(first["reward"][t], 3),
                    "last": round(last["reward"][t], 3),
                    "gain": round(last["reward"][t] - first["reward"][t], 3),
                }
                for t in tasks
            },
        }
    if args.png is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        for c, style in zip(curves, ("-", "--", ":", "-."), strict=False):
            for t in sorted({t for p in c["points"] for t in p["reward"]}):
                pts = [(p["samples"], p["reward"][t]) for p in c["points"] if t in p["reward"]]
                ax.plot(*zip(*pts, strict=True), style, marker="o", label=f"{t} ({c['mode']})")
        ax.set_xlabel("trained samples")
        ax.set_ylabel("mean reward, held-out prompts")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png)
        print(f"\ncurves: {args.png}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
