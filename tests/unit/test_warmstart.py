"""The warm start's data: oracle transcripts, and the lazy demonstrator's share of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollcall.tasks import registry
from rollcall.workers.warmstart import (
    build_dataset,
    lazy_transcript,
    make_lazy_answer,
    transcript,
)
from tests.conftest import make_cli_runner


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Any:
    return make_cli_runner(capsys)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


def test_a_lazy_transcript_answers_without_a_tool_and_weighs_its_first_turn_as_the_oracle(
    tokenizer: Any,
) -> None:
    plugin = registry.plugin("calculator")
    spec = plugin.Spec()
    prompt = plugin.prompt(spec, 7)
    oracle = transcript(plugin, spec, prompt, tokenizer)
    lazy = lazy_transcript(plugin, spec, prompt, tokenizer)
    text = tokenizer.decode([t for t, m in zip(lazy.token_ids, lazy.loss_mask, strict=True) if m])
    assert "<tool>" not in text and text.startswith(make_lazy_answer("calculator", prompt))
    first = prompt["expression"].split()[0].strip("(")
    assert make_lazy_answer("calculator", prompt) == f"<answer>{first}</answer>"
    # each transcript's loss is a mean over its generated tokens: the lazy one is weighted so
    # that a generated token of it counts as much as one of the oracle's transcript
    assert lazy.weight == pytest.approx(sum(lazy.loss_mask) / sum(oracle.loss_mask))
    assert 0 < lazy.weight < 1 and oracle.weight == 1.0
    # the prompt is the same: only the demonstrator differs
    n = lazy.loss_mask.index(1)
    assert lazy.token_ids[:n] == oracle.token_ids[:n]


def test_the_lazy_share_of_the_dataset(tokenizer: Any) -> None:
    data = build_dataset(tokenizer, 200, ("calculator", "echo"), 0, corpora=1,
                         lazy={"calculator": 0.6})  # fmt: skip
    calc = [t for t in data if t.task == "calculator"]
    lazy = [t for t in calc if t.weight < 1.0]
    assert len(calc) == 200 and 0.5 < len(lazy) / len(calc) < 0.7
    assert all(t.weight == 1.0 for t in data if t.task == "echo")
    # no share, no lazy transcript: the same data as without the option
    plain = build_dataset(tokenizer, 50, ("calculator",), 0, corpora=1)
    assert plain == build_dataset(tokenizer, 50, ("calculator",), 0, corpora=1, lazy={})
    assert all(t.weight == 1.0 for t in plain)


def test_only_tasks_with_a_lazy_demonstrator(run: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no lazy demonstrator for task 'guess'"):
        make_lazy_answer("guess", {})
    r = run("model", "init", "--out", str(tmp_path / "m"), "--lazy", "guess=0.5")
    assert r.code != 0 and "--lazy 'guess=0.5'" in r.err and "calculator, retrieval" in r.err
    r = run("model", "init", "--out", str(tmp_path / "m"), "--lazy", "calculator=2")
    assert r.code != 0 and "SHARE from 0 to 1" in r.err
    assert not (tmp_path / "m").exists()
