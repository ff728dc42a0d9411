"""Write ``tests/durations.json``, the seconds each test file took, from the output of a
pytest run with ``--durations=0`` (setup, call and teardown summed per file). The suite's
workers take the files longest first (tests/conftest.py), so that a long file never starts
last and runs alone while the other workers have finished.

    .venv/bin/pytest --durations=0 > /tmp/pytest.log; python ops/test_durations.py /tmp/pytest.log

A file missing from the table (a new one) goes after the known slow ones if it has a slow
test, else with the fast ones: refresh the table when the suite's shape changes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "tests" / "durations.json"
LINE = re.compile(r"^([0-9.]+)s (?:call|setup|teardown)\s+(tests/\S+?\.py)::", re.M)


def per_file(log: str) -> dict[str, float]:
    """Seconds per test file, from pytest's durations lines."""
    total: defaultdict[str, float] = defaultdict(float)
    for m in LINE.finditer(log):
        total[m.group(2)] += float(m.group(1))
    return {f: round(s, 1) for f, s in sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("log", type=Path, help="a pytest run's output, with --durations=0")
    args = ap.parse_args()
    table = per_file(args.log.read_text())
    if not table:
        sys.exit(f"{args.log}: no durations lines (run pytest with --durations=0)")
    TABLE.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{TABLE.relative_to(ROOT)}: {len(table)} files, {sum(table.values()):.0f} s in all")


if __name__ == "__main__":
    main()
