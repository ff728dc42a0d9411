"""Per-token log-probs (and entropy) of packed sequences under a causal LM.

The token at position t is scored by the logits at t - 1 of the same sequence, at the rollout's
sampling temperature (the behaviour log-probs were computed the same way from raw logits). The
first token of every sequence has no context and gets log-prob 0; it is a prompt token, never
trained. On kernels that take variable-length sequences from position ids (flash attention),
the row goes in with position ids alone; on eager and SDPA it carries the explicit block-diagonal
mask of ``PackedBatch.attention_mask``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from workers.trainer.packing import PackedBatch

_VARLEN_KERNELS = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn")


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
    model: Any, packed: PackedBatch, *, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-prob of each token, entropy of the distribution it was drawn from), both ``[T]``
    aligned with the packed row; 0 at each sequence's first token."""
    import torch

    logits = model(**model_inputs(model, packed)).logits[0, :-1].float() / temperature  # [T-1, V]
    targets = packed.input_ids[0, 1:]  # [T-1]
    lse = logits.logsumexp(-1)  # [T-1]
    lp = logits.gather(-1, targets[:, None])[:, 0] - lse  # [T-1]
    first = packed.position_ids[0] == 0  # [T]
    zero = lp.new_zeros(1)
    logp = torch.cat([zero, lp]).masked_fill(first, 0.0)  # [T]
    if not with_entropy:
        return logp, None
    probs = logits.softmax(-1)  # [T-1, V]
    ent = lse - (probs * logits).sum(-1)  # [T-1]
    return logp, torch.cat([zero, ent]).masked_fill(first, 0.0)
