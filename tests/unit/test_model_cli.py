"""``rollcall model init`` and ``rollcall rollout preview`` (small sizes, real model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import make_cli_runner


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Any:
    return make_cli_runner(capsys)


def test_model_init_then_preview(run: Any, tmp_path: Path) -> None:
    out = tmp_path / "m"
    r = run(
        "model",
        "init",
        "--out",
        str(out),
        "--hidden",
        "32",
        "--layers",
        "1",
        "--steps",
        "20",
        "--copy-steps",
        "10",
        "--eval-episodes",
        "2",
        "--json",
    )
    assert r.code == 0, r.err
    data = json.loads(r.out[r.out.index("{\n") :])  # progress lines, then the JSON object
    assert set(data["starting_reward"]) == {"calculator", "guess", "retrieval", "echo"}
    assert all(0.0 <= v <= 1.0 for v in data["starting_reward"].values())
    assert data["sft_loss"] < data["sft_loss_start"] - 1.0  # the warm start trained
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollcall.workers.tiny_model import build_tokenizer
    from rollcall.workers.warmstart import episode

    loaded = AutoTokenizer.from_pretrained(out)
    AutoModelForCausalLM.from_pretrained(out)  # any transformers user can load it
    # the saved tokenizer encodes exactly as the one the warm start trained with
    from rollcall.tasks import registry

    built = build_tokenizer()
    for name in ("calculator", "retrieval"):
        plugin = registry.plugin(name)
        spec = plugin.Spec()
        text = "".join(t for t, _ in episode(plugin, spec, plugin.prompt(spec, 3)))
        ids = built.encode(text, add_special_tokens=False)
        assert loaded.encode(text, add_special_tokens=False) == ids
        assert loaded.decode(ids) == text

    r = run(
        "rollout",
        "preview",
        "--task",
        "calculator",
        "--model",
        str(out),
        "-n",
        "2",
        "--json",
        "--max-tokens-per-turn",
        "16",
    )
    assert r.code == 0, r.err
    episodes = json.loads(r.out)
    assert len(episodes) == 2
    for ep in episodes:
        assert ep["turns"] and 0.0 <= ep["reward"] <= 1.0
        assert ep["trained_tokens"] == sum(t["generated_tokens"] for t in ep["turns"])
        assert ep["tokens"] > ep["trained_tokens"]
    r = run(
        "rollout",
        "preview",
        "--task",
        "guess",
        "--model",
        str(out),
        "-n",
        "1",
        "--max-tokens-per-turn",
        "8",
    )
    assert r.code == 0 and "episode 0: reward" in r.out and "tokens trained on" in r.out


def test_model_and_preview_refuse_bad_input(run: Any, tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    r = run("model", "init", "--out", str(tmp_path / "full"))
    assert r.code != 0 and "is not empty" in r.err
    r = run("rollout", "preview", "--task", "nope", "--model", str(tmp_path))
    assert r.code != 0 and "unknown task plugin 'nope'" in r.err
    r = run("rollout", "preview", "--task", "echo", "--model", str(tmp_path))
    assert r.code != 0 and "neither a built-in model (tiny, smollm2-135m) nor a folder" in r.err


def test_preview_defaults_to_the_tiny_model_and_takes_built_in_names(
    run: Any, tmp_path: Path, smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No --model: the shipped tiny model, put in ROLLCALL_HOME/models/tiny as a job would;
    --model smollm2-135m: the imported SmolLM2 in ROLLCALL_HOME/models (here, the session's)."""
    home = tmp_path / "home"
    monkeypatch.setenv("ROLLCALL_HOME", str(home))
    r = run("rollout", "preview", "--task", "echo", "-n", "1", "--max-tokens-per-turn", "4",
            "--json")  # fmt: skip
    assert r.code == 0, r.err
    assert json.loads(r.out)[0]["turns"]
    assert (home / "models" / "tiny" / "config.json").is_file()

    from rollcall.workers.realmodel import default_dir

    default_dir(home).parent.mkdir(parents=True, exist_ok=True)
    default_dir(home).symlink_to(smollm2_dir)  # imported once per test session
    r = run("rollout", "preview", "--task", "calculator", "--model", "smollm2-135m", "-n", "1",
            "--max-tokens-per-turn", "4", "--json")  # fmt: skip
    assert r.code == 0, r.err
    assert "importing" not in r.err  # the imported model was found, not imported again
    assert json.loads(r.out)[0]["turns"]
