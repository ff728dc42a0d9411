"""``ops/gpu/vllm_smoke.py --device cpu``: the adapter against real vLLM, every behaviour
log-prob checked against the trainer's own recomputation (float32: within 1e-4 per token)."""

from __future__ import annotations

import pytest

from tests.support.scripts import passing_report

pytestmark = pytest.mark.timeout(600)


def test_the_vllm_smoke_check_passes_on_cpu() -> None:
    report = passing_report("ops/gpu/vllm_smoke.py", "--device", "cpu", "--loops", "4")
    figures = report["figures"]
    assert report["dtype"] == "float32" and report["tolerance"] == 1e-4
    for part in ("agent_loops", "long", "after_load"):
        assert figures[part]["max_abs_err"] < 1e-4, figures
