"""Per-token log-probs (and entropy) of packed sequences under a causal LM.

The token at position t is scored by the logits at t - 1 of the same sequence, at the rollout's
sampling temperature (the behaviour log-probs were computed the same way from raw logits). The
first token of every sequence has no context and gets log-prob 0; it is a prompt token, never
trained. On kernels that take variable-length sequences from position ids (flash attention),
the row goes in with position ids alone; on eager and SDPA it carries the explicit block-diagonal
mask of ``PackedBatch.attention_mask``.

Full-vocabulary logits of a whole row (``[T, V]`` float32: 4.6 GiB for 8192 tokens of a 150k
vocabulary) would dominate the trainer's memory, so the output head is applied to
``chunk_tokens`` positions at a time: each chunk's logits are reduced to (log-prob, entropy)
and dropped, and recomputed in backward (non-reentrant checkpoint). The chunks are computed
inside the model's own forward, by hooks on its output embedding: under FSDP2 the root's
forward hooks are what gather its parameters (the embedding, tied to the head) and register
its backward, so the head must not be called from outside. The hooks assume the logits are the
head applied to the last hidden state (true of Qwen2, Llama, Mistral; not of models that
rescale or soft-cap the logits after the head, refused below).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from rollcall.workers.trainer.packing import PackedBatch

_VARLEN_KERNELS = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn")
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def model_inputs(model: Any, packed: PackedBatch) -> dict[str, Any]:
    """Forward kwargs for a packed row: varlen kernels infer sequence boundaries from the
    position ids; every other kernel gets the block-diagonal mask."""
    kwargs: dict[str, Any] = {
        "input_ids": packed.input_ids,
        "position_ids": packed.position_ids,
        "use_cache": False,
    }
    if getattr(model.config, "_attn_implementation", None) not in _VARLEN_KERNELS:
        kwargs["attention_mask"] = packed.attention_mask(model.dtype)
    return kwargs


def token_logprobs(
    model: Any,
    packed: PackedBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-prob of each token, entropy of the distribution it was drawn from), both ``[T]``
    aligned with the packed row; 0 at each sequence's first token. ``chunk_tokens``: positions
    per chunk of logits (0: the whole row at once, nothing recomputed)."""
    import torch

    for name in _LOGIT_TRANSFORMS:
        if getattr(model.config, name, None) not in (None, 1, 1.0):
            raise NotImplementedError(f"the model transforms its logits ({name})")
    head = model.get_output_embeddings()
    targets = packed.input_ids[0, 1:]  # [T-1]
    hidden: list[torch.Tensor] = []

    def keep_hidden(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden.append(args[0])
        return (args[0][:, :0], *args[1:])  # the head itself projects no position

    def score(module: Any, args: Any, output: Any) -> torch.Tensor:
        h = hidden.pop()[0, :-1]  # [T-1, H]
        return _scores(h, module, targets, temperature, with_entropy, chunk_tokens)

    hooks = [head.register_forward_pre_hook(keep_hidden), head.register_forward_hook(score)]
    try:
        scores = model(**model_inputs(model, packed)).logits  # [1 or 2, T-1]
    finally:
        for hook in hooks:
            hook.remove()
    first = packed.position_ids[0] == 0  # [T]
    out = torch.cat([scores.new_zeros(scores.shape[0], 1), scores], 1).masked_fill(first, 0.0)
    return out[0], out[1] if with_entropy else None


def _scores(
    hidden: torch.Tensor,
    head: Any,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    chunk_tokens: int,
) -> torch.Tensor:
    """Log-probs (and entropies) of ``targets`` under ``head(hidden)``, chunk by chunk; the
    chunks are recomputed in backward when chunked.  # [1 or 2, T-1]"""
    import torch
    from torch.utils.checkpoint import checkpoint

    n = hidden.shape[0]
    size = chunk_tokens or max(n, 1)
    recompute = 0 < chunk_tokens < n and torch.is_grad_enabled()  # one chunk: nothing to save
    parts = []
    for start in range(0, max(n, 1), size):
        args = (hidden[start : start + size], head.weight, head.bias, targets[start : start + size])
        if recompute:
            parts.append(checkpoint(_chunk, *args, temperature, with_entropy, use_reentrant=False))
        else:
            parts.append(_chunk(*args, temperature, with_entropy))
    return torch.cat(parts, 1)


def _chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> torch.Tensor:
    """One chunk's log-probs (and entropies), from its logits upcast to float32.  # [1 or 2, C]"""
    import torch
    import torch.nn.functional as F

    logits = F.linear(hidden, weight, bias).float() / temperature  # [C, V]
    lse = logits.logsumexp(-1)  # [C]
    lp = logits.gather(-1, targets[:, None])[:, 0] - lse  # [C]
    if not with_entropy:
        return lp[None]
    ent = lse - (logits.softmax(-1) * logits).sum(-1)  # [C]
    return torch.stack([lp, ent])
