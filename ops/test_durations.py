"""Write ``tests/durations.json``, the seconds each test file took, from the output of a
pytest run with ``--durations=0`` (setup, call and teardown summed per file). The suite's
workers take the files longest first (tests/conftest.py), so that a long file never starts
last and runs alone while the other workers have finished.

    .venv/bin/pytest --durations=0 > /tmp/pytest.log; python ops/test_durations.py /tmp/pytest.log

``.ci/run`` refreshes the table itself: with ``ROLLCALL_TEST_DURATIONS_OUT`` set, the test run
writes its own per-file seconds there when it ends (tests/conftest.py, ``table``), so the
table of the last CI run on a checkout is in that checkout, to commit.

A file missing from the table (a new one) goes after the known slow ones if it has a slow
test, else with the fast ones: refresh the table when the suite's shape changes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "tests" / "durations.json"
LINE = re.compile(r"^([0-9.]+)s (?:call|setup|teardown)\s+(tests/\S+?\.py)::", re.M)


def per_file(log: str) -> dict[str, float]:
    """Seconds per test file, from pytest's durations lines."""
    return table((m.group(2), float(m.group(1))) for m in LINE.finditer(log))


def table(phases: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Seconds per test file, longest first, from (file, seconds) pairs: each test's setup,
    call and teardown."""
    total: defaultdict[str, float] = defaultdict(float)
    for name, seconds in phases:
        total[name] += seconds
    return {f: round(s, 1) for f, s in sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))}


def write(seconds: dict[str, float], path: Path = TABLE) -> None:
    path.write_text(json.dumps(seconds, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("log", type=Path, help="a pytest run's output, with --durations=0")
    args = ap.parse_args()
    seconds = per_file(args.log.read_text())
    if not seconds:
        sys.exit(f"{args.log}: no durations lines (run pytest with --durations=0)")
    write(seconds)
    print(f"{TABLE.relative_to(ROOT)}: {len(seconds)} files, {sum(seconds.values()):.0f} s in all")


if __name__ == "__main__":
    main()
