"""Learning curves side by side, and async against sync at equal trained samples.

    python ops/bench/learning.py RUN_DIR [RUN_DIR ...] [--png curves.png]
    python ops/bench/learning.py --run [--config configs/quickstart.yaml] [--steps 80]
                                       [--sync-steps N] [--set KEY=VALUE ...] [--png curves.png]

The first form reads finished runs' ``metrics.jsonl``: held-out reward per task against
trained samples and wall time, one table per run. The second first runs the config twice in
``ROLLCALL_HOME`` (``rollcall run CONFIG job.name=learn-async-TIME`` and again with
``run.mode=sync``; ``--sync-steps`` stops the slower sync run sooner), then reads both.

Given one async and one sync run, it also compares them at equal trained samples: the most
samples both reached at an evaluation, each run's held-out reward there with its 95% interval,
the paired difference async - sync over the same held-out prompts (evaluation plays the same
prompts with the same per-prompt sampling seeds in every run, ``rollcall.workers.evaluation``) with
its interval, and the wall time each took to get there. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollcall.orchestrator.evalstats import Interval, mean_interval, paired_gain


def curve(run_dir: Path) -> dict[str, Any]:
    """Eval points of one run: step, trained samples, seconds since the first record, reward
    (mean) and rewards (per held-out prompt, where the records hold them)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"{run_dir}: no metrics.jsonl (not a run directory?)")
    records = [json.loads(line) for line in path.read_text().splitlines() if line]
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
            "rewards": r.get("rewards", {}),
        }
        for r in records
        if r.get("kind") == "eval"
    ]
    if not points:
        raise SystemExit(f"{run_dir}: no held-out evaluations")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    return {"run": str(run_dir), "mode": config["run"]["mode"], "points": points}


def at_samples(c: dict[str, Any], n: int) -> dict[str, Any]:
    """The last evaluation of run ``c`` at or below ``n`` trained samples."""
    return [p for p in c["points"] if p["samples"] <= n][-1]


def _fmt(i: Interval, sign: str = "") -> str:
    return f"{i.mean:{sign}.3f} [{i.low:{sign}.3f}, {i.high:{sign}.3f}]"


def compare(a: dict[str, Any], s: dict[str, Any]) -> dict[str, Any]:
    """Async run ``a`` against sync run ``s`` at the most trained samples both reached at an
    evaluation."""
    n = min(a["points"][-1]["samples"], s["points"][-1]["samples"])
    pa, ps = at_samples(a, n), at_samples(s, n)
    out: dict[str, Any] = {
        "samples": {"async": pa["samples"], "sync": ps["samples"]},
        "seconds": {"async": pa["seconds"], "sync": ps["seconds"]},
        "tasks": {},
    }
    print(
        f"\nat equal trained samples: async at {pa['samples']} ({pa['seconds']:.0f} s), "
        f"sync at {ps['samples']} ({ps['seconds']:.0f} s)"
    )
    print(f"{'task':<12} {'async [95%]':>22} {'sync [95%]':>22} {'async - sync [95%]':>24}")
    for t in sorted(set(pa["reward"]) & set(ps["reward"])):
        ra, rs = pa["rewards"].get(t), ps["rewards"].get(t)
        if not ra or not rs:  # records written before per-prompt rewards: means only
            row = {"async": pa["reward"][t], "sync": ps["reward"][t]}
            print(f"{t:<12} {row['async']:>22.3f} {row['sync']:>22.3f}")
        else:
            ia, is_ = mean_interval(ra), mean_interval(rs)
            d = paired_gain(rs, ra) if len(ra) == len(rs) else None
            row = {
                "async": [round(ia.mean, 4), round(ia.low, 4), round(ia.high, 4)],
                "sync": [round(is_.mean, 4), round(is_.low, 4), round(is_.high, 4)],
                "diff": None
                if d is None
                else [round(d.mean, 4), round(d.low, 4), round(d.high, 4)],
            }
            print(
                f"{t:<12} {_fmt(ia):>22} {_fmt(is_):>22} {'-' if d is None else _fmt(d, '+'):>24}"
            )
        out["tasks"][t] = row
    return out


def run_pair(config: Path, steps: int, sync_steps: int | None, overrides: list[str]) -> list[Path]:
    """Run ``config`` in async then in sync mode (in ``ROLLCALL_HOME``), each with the
    ``key=value`` ``overrides``; their run directories."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rollcall = [sys.executable, "-m", "rollcall.orchestrator.cli"]  # this interpreter's rollcall
    subprocess.run([*rollcall, "db", "upgrade"], check=True)
    dirs = []
    for mode, n in (("async", steps), ("sync", sync_steps or steps)):
        name = f"learn-{mode}-{stamp}"
        cmd = [
            *rollcall,
            "run",
            str(config),
            f"job.name={name}",
            f"run.mode={mode}",
            f"run.total_steps={n}",
            *overrides,
            "--no-live",
            "--json",
        ]
        print("$ rollcall " + " ".join(cmd[3:]), flush=True)
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
        result = json.loads(out[out.rfind("\n{\n") + 1 :])  # the JSON after rollcall's lines
        print(
            f"{mode}: {result['steps']} steps, {result['trained_samples']} samples in "
            f"{result['wall_s']:.0f} s",
            flush=True,
        )
        dirs.append(Path(result["run_dir"]))
    return dirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", type=Path)
    ap.add_argument("--run", action="store_true", help="run the config async, then sync")
    ap.add_argument("--config", type=Path, default=Path("configs/quickstart.yaml"))
    ap.add_argument("--steps", type=int, default=80, help="steps of each run (--run)")
    ap.add_argument("--sync-steps", type=int, default=None, help="steps of the sync run (--run)")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override (--run)"
    )
    ap.add_argument("--png", type=Path, default=None, help="write the curves here")
    args = ap.parse_args()
    if args.run == bool(args.runs):
        ap.error("give run directories, or --run (not both)")
    runs = run_pair(args.config, args.steps, args.sync_steps, args.set) if args.run else args.runs
    curves = [curve(r) for r in runs]
    summary: dict[str, Any] = {"runs": {}}
    for c in curves:
        tasks = sorted({t for p in c["points"] for t in p["reward"]})
        print(f"\n{c['run']} ({c['mode']})")
        print(f"{'step':>5} {'samples':>8} {'seconds':>8} " + " ".join(f"{t:>11}" for t in tasks))
        for p in c["points"]:
            cells = " ".join(f"{p['reward'].get(t, float('nan')):>11.3f}" for t in tasks)
            print(f"{p['step']:>5} {p['samples']:>8} {p['seconds']:>8.0f} {cells}")
        first, last = c["points"][0], c["points"][-1]
        summary["runs"][c["run"]] = {
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
                if t in first["reward"] and t in last["reward"]
            },
        }
    modes = [c["mode"] for c in curves]
    if sorted(modes) == ["async", "sync"]:
        summary["equal_samples"] = compare(
            curves[modes.index("async")], curves[modes.index("sync")]
        )
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
