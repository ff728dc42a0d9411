"""Published weights read straight into a model (``weights.load_into``): the same values as
``load_file`` + ``load_state_dict``, conversions where dtypes differ, refusals that change
nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollcall.workers.weights import load_into, publish


class Tiny(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4, dtype=dtype)
        self.proj = torch.nn.Linear(4, 3, dtype=dtype)
        self.lm_head = torch.nn.Linear(4, 11, bias=False, dtype=dtype)
        self.lm_head.weight = self.embed.weight  # tied, as the publisher leaves it out


def trained_state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    m = Tiny()
    sd = {k: v.detach().clone() + 0.5 for k, v in m.state_dict().items()}
    sd.pop("lm_head.weight")
    return sd


def test_load_into_matches_a_state_dict_load(tmp_path: Path) -> None:
    sd = trained_state(1)
    loc = publish(sd, tmp_path, 1)
    fast, slow = Tiny(), Tiny()
    load_into(fast, loc)
    slow.load_state_dict(load_file(str(Path(loc) / "model.safetensors")), strict=False)
    for (k, a), (_, b) in zip(fast.state_dict().items(), slow.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    assert torch.equal(fast.lm_head.weight, sd["embed.weight"])  # still tied to the embedding


def test_load_into_writes_into_the_existing_parameters(tmp_path: Path) -> None:
    m = Tiny()
    before = {k: v.data_ptr() for k, v in m.named_parameters()}
    load_into(m, publish(trained_state(2), tmp_path, 1))
    assert {k: v.data_ptr() for k, v in m.named_parameters()} == before  # in place, no new memory


def test_load_into_converts_a_different_dtype(tmp_path: Path) -> None:
    sd = trained_state(3)
    loc = publish({k: v.to(torch.bfloat16) for k, v in sd.items()}, tmp_path, 1)
    m = Tiny(torch.float32)
    load_into(m, loc)
    assert torch.equal(m.proj.weight, sd["proj.weight"].to(torch.bfloat16).float())


def test_a_file_that_does_not_fit_changes_nothing(tmp_path: Path) -> None:
    m = Tiny()
    snapshot = {k: v.clone() for k, v in m.state_dict().items()}
    extra = {**trained_state(4), "other.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"other\.weight"):
        load_into(m, publish(extra, tmp_path, 1))
    partial = trained_state(4)
    partial.pop("proj.bias")
    with pytest.raises(ValueError, match=r"proj\.bias"):
        load_into(m, publish(partial, tmp_path, 2))
    assert all(torch.equal(v, snapshot[k]) for k, v in m.state_dict().items())
    with pytest.raises(OSError):
        load_into(m, str(tmp_path / "v000009"))


def test_a_version_pinned_for_an_evaluation_outlives_keep_until_unpinned(tmp_path: Path) -> None:
    """An evaluation queued behind a slow evaluator reads its version after the trainer has
    published ``keep`` newer ones: the driver pins it when it queues the evaluation, pruning
    skips it, and the first publication after the unpin removes it."""
    from rollcall.workers.weights import pin, unpin, unpin_all

    sd = {"w": torch.zeros(2)}
    first = publish(sd, tmp_path, 1, keep=2)
    pin(first)
    for v in range(2, 6):
        publish(sd, tmp_path, v, keep=2)
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v000001", "v000004", "v000005"]
    unpin(first)
    publish(sd, tmp_path, 6, keep=2)
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v000005", "v000006"]
    # a driver killed with pins held: the next one clears them
    pin(publish(sd, tmp_path, 7, keep=2))
    unpin_all(tmp_path)
    publish(sd, tmp_path, 8, keep=2)
    publish(sd, tmp_path, 9, keep=2)
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v000008", "v000009"]
