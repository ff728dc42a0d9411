"""``tests/durations.json`` (the order the workers take the files in) and the script that
writes it from a pytest run's ``--durations=0`` lines."""

from __future__ import annotations

import json
from pathlib import Path

from ops.test_durations import TABLE, per_file

ROOT = Path(__file__).resolve().parents[2]


def test_seconds_are_summed_per_file_longest_first() -> None:
    log = (
        "============ slowest durations ============\n"
        "12.50s call     tests/unit/test_a.py::test_x[1]\n"
        "0.50s setup    tests/unit/test_a.py::test_x[1]\n"
        "20.00s call     tests/chaos/test_b.py::test_y\n"
        "3.00s teardown tests/unit/test_a.py::test_z\n"
        "(12 durations < 0.005s hidden.)\n"
    )
    assert list(per_file(log).items()) == [
        ("tests/chaos/test_b.py", 20.0),
        ("tests/unit/test_a.py", 16.0),
    ]


def test_the_table_names_only_test_files_that_exist() -> None:
    table = json.loads(TABLE.read_text())
    assert table and all((ROOT / name).is_file() for name in table), [
        name for name in table if not (ROOT / name).is_file()
    ]
    assert list(table.values()) == sorted(table.values(), reverse=True)
