"""Rebuild the shipped tiny model, or check that a rebuild gives the same bytes.

    python ops/tiny_model.py            # rebuild workers/models/tiny (and its BUILD.json)
    python ops/tiny_model.py --check    # rebuild in a temporary folder, compare byte for byte

The shipped model is exactly what ``rollcall model init`` builds with its defaults (one thread
and deterministic kernels, so every machine of this kind builds the same bytes). A first run
copies it into ``ROLLCALL_HOME/models/tiny`` instead of building it, so training starts at
once. ``BUILD.json`` records the command, every file's sha256, the starting reward per task on
held-out prompts and the build time; the install refuses a shipped file whose digest differs.
Rebuild after changing the tokenizer, the model, the warm start, the built-in tasks' text or
their defaults, and run ``--check`` before a release.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollcall.workers.tiny_model import BUILD_FILE, SHIPPED, file_digests  # noqa: E402

EVAL_EPISODES = 64


def build(out: Path) -> dict[str, object]:
    """Run ``rollcall model init`` with its defaults into ``out``; its JSON report."""
    cmd = [
        sys.executable,
        "-m",
        "rollcall.orchestrator.cli",
        "model",
        "init",
        "--out",
        str(out),
        "--eval-episodes",
        str(EVAL_EPISODES),
        "--json",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"rollcall model init failed:\n{done.stderr[-4000:]}")
    text = done.stdout  # progress lines, then the JSON report (indented)
    report: dict[str, object] = json.loads(text[text.rfind("\n{") + 1 :])
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare a rebuild with the shipped one")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rollcall-tiny-") as tmp:
        out = Path(tmp) / "tiny"
        t0 = time.monotonic()
        report = build(out)
        print(
            f"built in {time.monotonic() - t0:.0f} s: starting reward {report['starting_reward']}"
        )
        digests = file_digests(out)
        if args.check:
            shipped = json.loads((SHIPPED / BUILD_FILE).read_text())
            differ = sorted(
                n
                for n in digests.keys() | shipped["files"].keys()
                if digests.get(n) != shipped["files"].get(n)
            )
            if differ:
                print(f"the rebuild differs from the shipped model in: {', '.join(differ)}")
                return 1
            print(f"the rebuild equals the shipped model ({len(digests)} files)")
            return 0
        record = {
            "command": f"rollcall model init --out DIR --eval-episodes {EVAL_EPISODES}",
            "files": digests,
            "parameters": report["parameters"],
            "starting_reward": report["starting_reward"],
            "eval_episodes": EVAL_EPISODES,
            "build_seconds": report["seconds"],
        }
        shutil.rmtree(SHIPPED, ignore_errors=True)
        shutil.copytree(out, SHIPPED)
        (SHIPPED / BUILD_FILE).write_text(json.dumps(record, indent=2) + "\n")
        print(f"shipped in {SHIPPED.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
