"""The sums agent of ``configs/smollm2-lora.yaml`` (``examples/sums/agent.py``): its reward on
hand-picked replies, and its prompt file as ``examples/make_prompts.py`` writes it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _agent() -> object:
    spec = importlib.util.spec_from_file_location("sums_agent", ROOT / "examples/sums/agent.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("reply", "reward"),
    [
        ("22", 1.0),
        (" 22. ", 1.0),
        ("14 + 8 = 22", 1.0),
        ("The answer is 22.", 1.0),
        ("22 is 14 + 8", 0.0),  # its last number is not the sum
        ("twenty-two", 0.0),
        ("", 0.0),
        (None, 0.0),
    ],
)
def test_the_reward_is_the_last_number_being_the_sum(reply: str | None, reward: float) -> None:
    assert _agent().score(reply, "22") == reward  # type: ignore[attr-defined]


def test_the_prompts_are_every_pair_once() -> None:
    rows = [json.loads(x) for x in (ROOT / "examples/sums/sums.jsonl").read_text().splitlines()]
    assert len(rows) == 15 * 15 and len({r["question"] for r in rows}) == len(rows)
    assert rows[0] == {"answer": "2", "question": "What is 1 + 1?"}
    assert all(int(r["answer"]) == sum(map(int, r["question"][8:-1].split(" + "))) for r in rows)
