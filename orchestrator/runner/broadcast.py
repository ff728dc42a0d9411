"""The driver's side of the collective weight transport (``trainer.weights.transport:
collective``, ``workers/collective.py``): after a step that published a version commits, form
the group of this membership epoch from the live rollout nodes, have the trainer's rank 0
broadcast the version while every member receives it, and, when the broadcast failed, re-form
the group once from the members that answered (a member that did not answer within the
deadline, dead or hung, is dropped) and broadcast again. Whoever still lacks the version loads
it from its file. Each broadcast is a ``weights.broadcast`` event (version, epochs, members,
who loaded it, who was dropped, seconds)."""

from __future__ import annotations

import logging
import time
from typing import Any

from rollcall.orchestrator.config import WeightsConfig
from rollcall.workers import collective

log = logging.getLogger(__name__)

EVENT = "weights.broadcast"
ATTEMPTS = 2  # the first group, then one re-formed from the members that answered


class Broadcaster:
    def __init__(self, config: WeightsConfig, device: str) -> None:
        self.config = config
        self.backend = "nccl" if device.startswith("cuda") else "gloo"
        self.epoch = 0  # membership epochs formed by this driver

    def run(self, version: int, trainer: Any, members: list[tuple[str, Any]]) -> dict[str, Any]:
        """Broadcast ``version`` to ``members`` ((name, actor) pairs); what happened."""
        import ray

        base = trainer.weights_offer()
        t0 = time.monotonic()
        out: dict[str, Any] = {
            "version": version,
            "members": [n for n, _ in members],
            "epochs": [],
            "loaded": [],
            "dropped": [],
            "errors": {},
        }
        if base is None or base["version"] != version:
            return out
        tensors = tuple(collective.Tensor(n, d, tuple(s), b) for n, d, s, b in base["tensors"])
        out["bytes"] = sum(t.nbytes for t in tensors)  # each member's share (LoRA: the adapter)
        out["adapter"] = base.get("adapter") is not None
        bucket_bytes = int(self.config.bucket_mb * 2**20)
        deadline = self.config.timeout_s * (len(collective.buckets(tensors, bucket_bytes)) + 3)
        for _ in range(ATTEMPTS):
            if not members:
                break
            self.epoch += 1
            offer = collective.Offer(
                version=version,
                epoch=self.epoch,
                host=base["host"],
                port=base["port"],
                world=len(members) + 1,
                rank=0,
                tensors=tensors,
                bucket_bytes=bucket_bytes,
                timeout_s=self.config.timeout_s,
                backend=self.backend,
                adapter=base.get("adapter"),
            )
            out["epochs"].append(self.epoch)
            send = trainer.broadcast(offer.to_json())
            refs = [
                actor.receive_weights.remote(offer.for_rank(i + 1).to_json())
                for i, (_, actor) in enumerate(members)
            ]
            # The sender ends within its own timeouts; then every member still alive ends
            # within one more (its last receive), and one that does not is dropped.
            ray.wait([send], timeout=deadline)
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.config.timeout_s)
            done = set(ready)
            if ray.wait([send], timeout=0)[0]:
                done.add(send)
            sent = send in done and _ok(send, out, "trainer")
            answered = []
            for (name, actor), ref in zip(members, refs, strict=True):
                if ref not in done:  # hung or stopped: dropped from this version
                    out["dropped"].append(name)
                    continue
                try:
                    r = ray.get(ref)
                except Exception as e:  # the actor died
                    out["dropped"].append(name)
                    out["errors"][name] = f"{type(e).__name__}: {e}"[:300]
                    continue
                if r["loaded"] or r.get("already"):
                    out["loaded"].append(name)
                else:
                    out["errors"][name] = r["error"]
                    answered.append((name, actor))
            if sent:
                break
            members = answered
        for name in out["loaded"]:  # an earlier attempt's error, since recovered from
            out["errors"].pop(name, None)
        out["seconds"] = round(time.monotonic() - t0, 3)
        return out


def _ok(ref: Any, out: dict[str, Any], who: str) -> bool:
    import ray

    try:
        ray.get(ref)
        return True
    except Exception as e:
        out["errors"][who] = f"{type(e).__name__}: {e}"[:300]
        return False


def describe(result: dict[str, Any]) -> str:
    """One line for the event log."""
    loaded, members = len(result["loaded"]), len(result["members"])
    text = f"version {result['version']} broadcast to {loaded} of {members} nodes"
    if result["dropped"]:
        text += f"; dropped {', '.join(result['dropped'])}"
    if len(result["epochs"]) > 1:
        text += f"; group re-formed (epochs {result['epochs']})"
    missed = [m for m in result["members"] if m not in result["loaded"]]
    if missed:
        text += f"; {', '.join(missed)} load it from its file"
    return text + f" ({result.get('seconds', 0):.2f} s)"
