"""A tiny Qwen2-architecture model and its tokenizer, built locally with no downloads.

``build_tokenizer`` trains a byte-level BPE on text from the built-in tasks (their prompts and
the chat format), with the chat markers as special tokens; ``build_model`` makes a small
randomly initialised ``Qwen2ForCausalLM`` sized to it. Both are saved with ``save_pretrained``,
so any transformers user can load them. Deterministic for a seed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

PAD = "<|pad|>"


def corpus_lines(n_per_task: int = 300) -> Iterator[str]:
    """Text the tokenizer is trained on: task statements, tool observations, answers."""
    from tasks import registry
    from workers.rollout.chat import prompt_text

    for name in registry.available():
        plugin = registry.get(name)
        spec = plugin.Spec()
        for i in range(n_per_task):
            p = plugin.prompt(spec, i)
            yield prompt_text(plugin.tools(spec), plugin.instructions(spec, p))
            yield " ".join(f"{k} {v}" for k, v in p.items())
    yield '<tool>{"name": "calc", "arguments": {"expression": "12 * 7 - 5"}}</tool>'
    yield "<answer>0 1 2 3 4 5 6 7 8 9</answer> higher lower correct"


def build_tokenizer(vocab_size: int = 1024) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from workers.rollout.chat import END, SPECIAL_TOKENS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, *SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus_lines()), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=END,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t != END],
    )


def build_model(
    tokenizer: Any, *, hidden: int = 64, layers: int = 2, heads: int = 4, seed: int = 0
) -> Any:
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
    )
    model = Qwen2ForCausalLM(config)
    model.eval()
    return model


def build_tiny(out: Path, *, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    """Tokenizer + random-init model, saved to ``out``."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, hidden=hidden, layers=layers, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    return out
