"""The weight broadcast over real gloo groups between real processes: a version arrives whole
and bit-exact; a member killed or stopped mid-broadcast fails the group within its timeout for
everyone, nobody keeps a partial version, nobody hangs or crashes, and the group re-formed
from the survivors completes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest
import torch

from rollcall.workers import collective
from rollcall.workers.collective import BroadcastFailed, Offer, Rendezvous

TIMEOUT_S = 3.0  # an offer that must fail: its bound
# an offer that must succeed: the trainer's default (trainer.weights.timeout_s). Forming a group
# waits for every member to listen, which on a loaded machine (load 5-14 on two cores) takes
# more than 3 s after a member's previous group failed
OK_TIMEOUT_S = 30.0
READY = (0, "ready")


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(300, 200, generator=g),
        "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "c.big": torch.randn(600, 500, generator=g),  # larger than a bucket: its own
        "d.int": torch.arange(10, dtype=torch.int64),
    }


def _offer(
    rv: Rendezvous, version: int, epoch: int, world: int, timeout_s: float = OK_TIMEOUT_S
) -> Offer:
    return Offer(
        version=version,
        epoch=epoch,
        host=rv.host,
        port=rv.port,
        world=world,
        rank=0,
        tensors=collective.describe(_state()),
        bucket_bytes=256 * 1024,
        timeout_s=timeout_s,
    )


def _bytes(t: torch.Tensor) -> tuple[str, bytes]:
    return str(t.dtype), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _member(offers: list[dict[str, Any]], who: str, out: Any) -> None:
    """A member process: "ready" once started (torch imported: seconds on a loaded machine, which
    the offer's timeout must not include), then each offer in turn; puts (epoch, digest or
    error) for each."""
    out.put(READY)
    for d in offers:
        try:
            got = collective.receive(Offer.from_json(d), who=who)
            out.put((d["epoch"], {k: _bytes(v) for k, v in got.items()}))
        except BroadcastFailed as e:
            out.put((d["epoch"], str(e)))


def _start(offers: list[Offer], who: str, env: dict[str, str] | None = None) -> tuple[Any, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        p = ctx.Process(target=_member, args=([o.to_json() for o in offers], who, out))
        p.start()
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert out.get(timeout=120) == READY
    return p, out


def test_buckets_pack_in_order_and_a_large_tensor_goes_alone() -> None:
    tensors = collective.describe(_state())
    assert [t.name for t in tensors] == ["a.weight", "b.bias", "c.big", "d.int"]
    assert collective.buckets(tensors, 256 * 1024) == [[0, 1], [2], [3]]
    assert collective.buckets(tensors, 1) == [[0], [1], [2], [3]]


def test_a_version_arrives_whole_and_bit_exact_at_every_member() -> None:
    rv = Rendezvous("127.0.0.1")
    state = _state()
    offer = _offer(rv, 1, 1, 3)
    members = [_start([offer.for_rank(r)], f"m{r}") for r in (1, 2)]
    collective.send(rv, offer, state)
    for p, out in members:
        epoch, got = out.get(timeout=60)
        assert epoch == 1 and isinstance(got, dict), got
        assert set(got) == set(state)
        for k, v in state.items():
            assert got[k] == _bytes(v), k
        p.join(timeout=30)
        assert p.exitcode == 0


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_member_lost_mid_broadcast_fails_the_group_then_the_survivors_complete(
    fault: str,
) -> None:
    rv = Rendezvous("127.0.0.1")
    state = _state(1)
    first = _offer(rv, 2, 1, 3, TIMEOUT_S)
    again = _offer(rv, 2, 2, 2)  # re-formed without the lost member
    survivor, s_out = _start([first.for_rank(1), again.for_rank(1)], "m1")
    lost, _ = _start([first.for_rank(2)], "m2", {collective.FAULT_ENV: f"{fault}:0:m2"})
    t0 = time.monotonic()
    with pytest.raises(BroadcastFailed):
        collective.send(rv, first, state)
    assert time.monotonic() - t0 < 6 * TIMEOUT_S  # bounded: never a hang
    epoch, got = s_out.get(timeout=60)
    assert epoch == 1 and isinstance(got, str), "the survivor kept nothing of the failed group"
    collective.send(rv, again, state)  # this process survived its aborted group
    epoch, got = s_out.get(timeout=60)
    assert epoch == 2 and all(got[k] == _bytes(v) for k, v in state.items())
    survivor.join(timeout=30)
    assert survivor.exitcode == 0
    if fault == "stop":
        os.kill(lost.pid, signal.SIGKILL)
    lost.join(timeout=30)
