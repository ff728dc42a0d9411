"""Sequence packing: variable-length trajectories into micro-batches under a token budget.

``plan_micro_batches`` bins sequences by first-fit-decreasing and spreads the bins over the
data-parallel ranks so each rank gets the same number of micro-batches (empty ones where the
count does not divide) and about the same number of tokens. ``pack`` lays a micro-batch out as
one row: tokens concatenated, position ids restarting at 0 for every sequence, and a
block-diagonal causal mask so a token attends only to earlier tokens of its own sequence.
Per-token values (loss masks, advantages, log-probs) are concatenated in the same order, and
``unpack`` splits a per-token result back per sequence. Pure except for the tensors it builds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Bins of sequence indices whose lengths sum to at most ``budget``. Longest first, each
    into the first bin it fits; a sequence longer than the budget gets a bin of its own."""
    if budget < 1:
        raise ValueError(f"the token budget must be positive, got {budget}")
    if any(n < 1 for n in lengths):
        raise ValueError("every sequence has at least one token")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        n = lengths[i]
        for b, load in enumerate(loads):
            if load + n <= budget:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    return bins


def plan_micro_batches(
    lengths: Sequence[int], budget: int, ranks: int = 1
) -> list[list[list[int]]]:
    """For each rank, its micro-batches (lists of sequence indices into ``lengths``).

    Sequences go longest first to the rank with the fewest tokens so far (so the ranks' loads
    differ by at most one sequence), each rank's share is packed by first-fit-decreasing, and
    every rank gets the same number of micro-batches (FSDP ranks must run the same collectives),
    padded with empty ones."""
    if ranks < 1:
        raise ValueError(f"ranks must be positive, got {ranks}")
    shares: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        shares[rank].append(i)
        load[rank] += lengths[i]
    plan = [
        [[share[j] for j in b] for b in first_fit_decreasing([lengths[i] for i in share], budget)]
        for share in shares
    ]
    count = max(1, max(len(micro) for micro in plan))
    for micro in plan:
        micro.extend([] for _ in range(count - len(micro)))
    return plan


@dataclass(frozen=True)
class PackedBatch:
    """Sequences laid end to end in one row."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], restarting at 0 for each sequence
    lengths: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def sequence_ids(self) -> torch.Tensor:
        """Which sequence each token belongs to.  # [T]"""
        import torch

        return torch.repeat_interleave(
            torch.arange(len(self.lengths)), torch.tensor(self.lengths)
        ).to(self.input_ids.device)

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """Additive block-diagonal causal mask: 0 where a query may attend a key (same sequence,
        not later), the dtype's minimum elsewhere. Works with the eager and SDPA kernels.
        # [1, 1, T, T]"""
        import torch

        seq = self.sequence_ids()
        n = seq.numel()
        causal = torch.ones((n, n), dtype=torch.bool, device=seq.device).tril()
        allowed = causal & (seq[:, None] == seq[None, :])
        mask = torch.zeros((n, n), dtype=dtype, device=seq.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[None, None]

    def unpack(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Split a per-token tensor of the packed row back into one tensor per sequence."""
        if flat.shape[-1] != self.tokens:
            raise ValueError(f"expected {self.tokens} tokens, got {flat.shape[-1]}")
        return list(flat.split(list(self.lengths), dim=-1))


def pack(sequences: Sequence[Sequence[int]], device: str | torch.device = "cpu") -> PackedBatch:
    """Lay token-id sequences end to end in one row."""
    import torch

    if not sequences:
        raise ValueError("nothing to pack")
    lengths = tuple(len(s) for s in sequences)
    if min(lengths) < 1:
        raise ValueError("every sequence has at least one token")
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
    pos = torch.cat([torch.arange(n, device=device) for n in lengths])
    return PackedBatch(ids[None], pos[None], lengths)


def pack_values(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-token values of the sequences in packing order.  # [T]"""
    import torch

    return torch.cat([v.reshape(-1) for v in values])


def padded_slots(lengths: Sequence[int], micro_batches: Sequence[Sequence[int]]) -> int:
    """Token slots when each micro-batch is a rectangle padded to its longest sequence."""
    return sum(len(b) * max(lengths[i] for i in b) for b in micro_batches if b)
