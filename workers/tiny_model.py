"""A tiny Qwen2-architecture model and its tokenizer, built locally with no downloads.

``build_tokenizer`` trains a byte-level BPE on text from the built-in tasks (their prompts and
the chat format), with the chat markers as special tokens; ``build_model`` makes a small
randomly initialised ``Qwen2ForCausalLM`` sized to it. Both are saved with ``save_pretrained``,
so any transformers user can load them. Deterministic for a seed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rollcall.orchestrator.folders import replace_folder
from rollcall.tasks import registry
from rollcall.tasks.retrieval import NAMES
from rollcall.workers.episode.chat import END, ROLLCALL_TEMPLATE, SPECIAL_TOKENS, prompt_text
from rollcall.workers.warmstart import episode

PAD = "<|pad|>"


# Words, single digits, whitespace and punctuation never share a token: a name, a word or a
# number is the same tokens wherever it appears (after a space, a quote, a dash or ">"), so
# copying it from the prompt or an observation into a turn is a plain token-by-token copy,
# and numbers are digit by digit (whole-number tokens measured worse for the tiny model).
COPY_SPLIT = r"\p{L}+|\p{N}|\s+|[^\s\p{L}\p{N}]+"


def corpus_lines(n_per_task: int = 300) -> Iterator[str]:
    """Text the tokenizer is trained on: task statements and the oracle's solved episodes
    (tool calls, observations, answers) of every built-in task that has an oracle."""
    for name, info in registry.available().items():
        if info.source in ("benchmark", "agent"):  # timing models; the user's own agents
            continue
        plugin = registry.plugin(name)
        spec = plugin.Spec()
        for i in range(n_per_task):
            p = plugin.prompt(spec, i)
            try:
                yield "".join(text for text, _ in episode(plugin, spec, p))
            except ValueError:  # no oracle for this task
                yield prompt_text(plugin.tools(spec), plugin.instructions(spec, p))
            yield " ".join(f"{k} {v}" for k, v in p.items())
    yield '<tool>{"name": "calc", "arguments": {"expression": "12 * 7 - 5"}}</tool>'
    yield "<answer>0 1 2 3 4 5 6 7 8 9</answer> higher lower correct"


def build_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE trained on the built-in tasks' text, pre-split by ``COPY_SPLIT``, plus
    the retrieval task's place names as whole-word tokens; saved as a ``tokenizer.json`` that
    ``AutoTokenizer`` loads to the same encoding."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(COPY_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, *SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus_lines()), trainer=trainer)
    # Every place name of the retrieval task is one token (whole words only): the tiny model
    # copies one token from a question or a document reliably, a run of letters it does not.

    tok.add_tokens([AddedToken(n, single_word=True) for n in NAMES])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=END,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t != END],
    )
    fast.chat_template = ROLLCALL_TEMPLATE  # saved with it: the agent loop renders with it
    return fast


def build_model(
    tokenizer: Any,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    init_std: float = 0.02,
    seed: int = 0,
) -> Any:
    """A randomly initialised ``Qwen2ForCausalLM`` for ``tokenizer``. A tiny model to be trained
    from scratch learns to attend (and so to copy) much sooner from a wider initialisation than
    the default 0.02 (``init_std`` 0.1 for the warm start)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        initializer_range=init_std,
    )
    model = Qwen2ForCausalLM(config)
    model.eval()
    return model


def build_tiny(
    out: Path, *, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4
) -> Path:
    """Tokenizer + random-init model, saved to ``out``. vLLM's CPU attention needs a head size
    of 32 or more (``hidden / heads``)."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, hidden=hidden, layers=layers, heads=heads, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    return out


# The tiny model that ``rollcall model init`` builds with its defaults, shipped with the package
# so that a first run starts training at once; ``python ops/tiny_model.py`` rebuilds it (and
# ``--check`` compares a rebuild with it, byte for byte).
SHIPPED = Path(__file__).parent / "models" / "tiny"
BUILD_FILE = "BUILD.json"


@contextmanager
def deterministic_build() -> Iterator[None]:
    """One thread and deterministic kernels while a model is built: the same seed gives the
    same bytes on every machine of this kind (a thread count changes how sums are split)."""
    import torch

    threads, strict = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(strict)
        torch.set_num_threads(threads)


def file_digests(folder: Path) -> dict[str, str]:
    """sha256 of every file of a model folder but ``BUILD.json``, by name."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != BUILD_FILE
    }


def shipped_build() -> dict[str, Any] | None:
    """The shipped model's build record (how it was built, its files' digests, its starting
    rewards), or None when this installation carries no shipped model."""
    record = SHIPPED / BUILD_FILE
    return json.loads(record.read_text()) if record.exists() else None


def install_shipped(path: Path) -> Path:
    """Copy the shipped tiny model to ``path`` (written aside and renamed, so a crash leaves
    nothing half-written), after checking each file against its recorded digest."""
    build = shipped_build()
    if build is None:
        raise FileNotFoundError(f"no shipped tiny model in {SHIPPED}")
    found = file_digests(SHIPPED)
    if found != build["files"]:
        bad = sorted(set(found.items()) ^ set(build["files"].items()))
        raise ValueError(f"the shipped tiny model in {SHIPPED} does not match {BUILD_FILE}: {bad}")
    return replace_folder(path, lambda tmp: shutil.copytree(SHIPPED, tmp))
