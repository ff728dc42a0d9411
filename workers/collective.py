"""Weights over collectives: the trainer broadcasts a published version to the rollout engines.

``trainer.weights.transport: collective``. After a step commits, the driver forms a group for
the new version from the live rollout nodes (a *membership epoch*: the trainer's rank 0 is rank
0, each member node one more rank) and has rank 0 broadcast the version's tensors to them over
``torch.distributed`` (gloo on CPU, NCCL on GPU), in buckets of ``bucket_mb``, while each member
receives into staging memory. Only a version received whole is loaded, with the same in-place
load and checks as a file (``HFEngine.load_state``, the vLLM worker extension's
``rollcall_receive_weights``), so an engine never generates with half-loaded weights.

Every step has a timeout. A member that dies or hangs during a broadcast makes it fail for the
whole group (the root sends to every member in turn); the group is then aborted
(``ProcessGroup.abort``: destroying a gloo group with an operation pending aborts the process),
the driver re-forms it once from the members that answered and broadcasts again, and whoever
still lacks the version loads it from its files, which rank 0 writes as the durable copy. The
rendezvous is a ``TCPStore`` served by rank 0 for its whole life; each group uses its own key
prefix (``v{version}e{epoch}``), so a late or dead member of an old group cannot disturb a new
one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

# Test seam (a named fake of a node failing mid-broadcast): ``stop:B:WHO`` or ``kill:B:WHO``
# makes the receiver called WHO SIGSTOP or SIGKILL itself after receiving bucket B.
FAULT_ENV = "ROLLCALL_TEST_BROADCAST_FAULT"


class BroadcastFailed(RuntimeError):
    """A broadcast did not complete for this process (a peer died, hung or never came); the
    group was aborted and nothing received was applied."""


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # a torch dtype's name: float32, bfloat16, ...
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Offer:
    """What a member needs to join a broadcast: the version, the group (rendezvous, size, its
    rank, the epoch that names it), the tensors in order and how they are bucketed."""

    version: int
    epoch: int
    host: str
    port: int
    world: int
    rank: int
    tensors: tuple[Tensor, ...]
    bucket_bytes: int
    timeout_s: float
    backend: str = "gloo"  # or nccl
    # a LoRA version (``trainer.lora``): the adapter's peft config (``adapter_config.json``);
    # the tensors are then the adapter alone, by model parameter name. None: full weights.
    adapter: dict[str, Any] | None = None

    def for_rank(self, rank: int) -> Offer:
        return Offer(**{**asdict(self), "tensors": self.tensors, "rank": rank})

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["tensors"] = [[t.name, t.dtype, list(t.shape), t.nbytes] for t in self.tensors]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Offer:
        tensors = tuple(Tensor(n, dt, tuple(s), nb) for n, dt, s, nb in d["tensors"])
        return cls(**{**d, "tensors": tensors})


def describe(state: dict[str, Any]) -> tuple[Tensor, ...]:
    """The tensors of a state dict, in a fixed order (by name)."""
    return tuple(
        Tensor(k, str(v.dtype).removeprefix("torch."), tuple(v.shape), v.numel() * v.element_size())
        for k, v in sorted(state.items())
    )


def buckets(tensors: tuple[Tensor, ...], bucket_bytes: int) -> list[list[int]]:
    """Consecutive tensors packed into buckets of at most ``bucket_bytes`` (a larger tensor is
    a bucket of its own)."""
    out: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        if not out or (size + t.nbytes > bucket_bytes and out[-1]):
            out.append([])
            size = 0
        out[-1].append(i)
        size += t.nbytes
    return out


class Rendezvous:
    """Rank 0's ``TCPStore``, served for the process's life (one per trainer rank 0)."""

    def __init__(self, host: str) -> None:
        import torch.distributed as dist

        self.host = host
        self.store = dist.TCPStore(
            host, 0, None, True, timedelta(seconds=60), wait_for_workers=False
        )
        self.port = int(self.store.port)


def _group(
    store: Any, prefix: str, rank: int, world: int, timeout_s: float, host: str, backend: str
) -> Any:
    import torch.distributed as dist

    prefixed = dist.PrefixStore(prefix, store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":  # GPU: rank 0's and the engines' devices are already set
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world, opts)
    gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    gloo._timeout = timeout
    gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(prefixed, rank, world, gloo)


def _broadcast(group: Any, flat: Any, timeout_s: float, backend: str) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.timeout = timedelta(seconds=timeout_s)
    work = group.broadcast([flat], opts)
    if backend == "nccl":
        # NCCL's plain wait() only orders the current CUDA stream after the operation; with a
        # timeout it blocks this thread until the operation completes, and raises when it does
        # not within the timeout, so a dead or hung member fails the broadcast here, as on gloo
        work.wait(timedelta(seconds=timeout_s))
    else:
        work.wait()


def _abort(group: Any) -> None:
    """A failed group is aborted (destroying it with an operation pending would abort the
    process) and kept referenced: some backends block in their destructor."""
    with contextlib.suppress(Exception):  # already broken beyond abort: nothing to release
        group.abort()
    _ABORTED.append(group)


_ABORTED: list[Any] = []
_LOCAL_HOST = "127.0.0.1"


def local_address() -> str:
    """This machine's address as the other members see it: Ray's node address when Ray is
    running, else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except Exception:
        pass
    return _LOCAL_HOST


def send(rendezvous: Rendezvous, offer: Offer, state: dict[str, Any]) -> float:
    """Rank 0: broadcast ``state`` (tensors as ``offer.tensors`` says) to the group; returns
    the seconds it took. Raises ``BroadcastFailed`` (the group aborted) when any member fails."""
    import torch

    t0 = time.perf_counter()
    prefix = f"v{offer.version}e{offer.epoch}"
    device = "cuda" if offer.backend == "nccl" else "cpu"
    try:
        group = _group(
            rendezvous.store, prefix, 0, offer.world, offer.timeout_s, offer.host, offer.backend
        )
    except Exception as e:
        raise BroadcastFailed(f"forming the group of version {offer.version}: {e}") from e
    try:
        for idx in buckets(offer.tensors, offer.bucket_bytes):
            parts = [
                state[offer.tensors[i].name].detach().contiguous().view(-1).view(torch.uint8)
                for i in idx
            ]
            flat = torch.cat(parts).to(device) if len(parts) > 1 else parts[0].to(device)
            _broadcast(group, flat, offer.timeout_s, offer.backend)
    except Exception as e:
        _abort(group)
        raise BroadcastFailed(f"broadcasting version {offer.version}: {e}") from e
    _release(group)
    return time.perf_counter() - t0


def receive(
    offer: Offer, device: str = "cpu", who: str = "", address: str | None = None
) -> dict[str, Any]:
    """A member: join the group and receive the version whole; the tensors, on ``device``.
    Raises ``BroadcastFailed`` (the group aborted, nothing returned) when it does not complete
    within the offer's timeouts. ``address``: this machine's, as the others reach it
    (default ``local_address()``)."""
    import torch
    import torch.distributed as dist

    fault = os.environ.get(FAULT_ENV, "")
    prefix = f"v{offer.version}e{offer.epoch}"
    try:
        store = dist.TCPStore(
            offer.host,
            offer.port,
            None,
            False,
            timedelta(seconds=offer.timeout_s),
            wait_for_workers=False,
        )
        group = _group(
            store,
            prefix,
            offer.rank,
            offer.world,
            offer.timeout_s,
            address or local_address(),
            offer.backend,
        )
    except Exception as e:
        raise BroadcastFailed(f"joining the group of version {offer.version}: {e}") from e
    out: dict[str, Any] = {}
    try:
        for b, idx in enumerate(buckets(offer.tensors, offer.bucket_bytes)):
            size = sum(offer.tensors[i].nbytes for i in idx)
            flat = torch.empty(size, dtype=torch.uint8, device=device)
            _broadcast(group, flat, offer.timeout_s, offer.backend)
            at = 0
            for i in idx:
                t = offer.tensors[i]
                out[t.name] = flat[at : at + t.nbytes].view(getattr(torch, t.dtype)).view(t.shape)
                at += t.nbytes
            _maybe_fault(fault, b, who)
    except Exception as e:
        _abort(group)
        raise BroadcastFailed(f"receiving version {offer.version}: {e}") from e
    _release(group)
    return out


def _release(group: Any) -> None:
    try:
        group.shutdown()
    except Exception:
        _abort(group)


def _maybe_fault(fault: str, bucket: int, who: str) -> None:
    kind, _, rest = fault.partition(":")
    at, _, target = rest.partition(":")
    if kind in ("stop", "kill") and at.isdigit() and int(at) == bucket and target == who:
        sig = signal.SIGSTOP if kind == "stop" else signal.SIGKILL
        threading.Thread(target=os.kill, args=(os.getpid(), sig), daemon=True).start()
        time.sleep(60)  # the signal lands before this returns
