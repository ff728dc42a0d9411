"""Benchmark of weight synchronisation: publish -> loaded by every rollout node, against model
size, compared with the raw copy bound of the transport.

The transport is rollcall's: safetensors files in a shared folder. The trainer publishes a
version with ``rollcall.workers.weights.publish`` (written aside, renamed into place, the
last few kept); each rollout node loads it as the ``hf`` engine does (``load_weights``: the file's
bytes read straight into the model's parameters, ``weights.load_into``; the previous loader,
``load_file`` then ``load_state_dict``, is timed too). Here the state dicts are synthetic
(bf16 tensors of 4M parameters each, 10M to 500M parameters), the nodes are Ray actors that
each hold parameters of
the same shapes, and they load concurrently as soon as the version is published (the time a
node takes to notice a new version, up to one heartbeat, is not part of this figure).

The bound is the same bytes moved by plain file IO on the same file system: one sequential
write of every tensor's memory into a file, then every node reading that file into its
parameters' memory (``readinto``) concurrently. Both sides run in the page cache (no fsync;
neither does the publisher), which is where a freshly written file is read from on one machine;
dirty pages are flushed (``os.sync``) before each of the two writes, outside the timings.

``--transport collective`` measures rollcall's other transport instead (``trainer.weights.
transport: collective``, ``workers/collective.py``): this process, as the trainer's rank 0,
broadcasts the version over gloo to 1-N node actors (a group per version, buckets of
``--bucket-mb``), each receiving it whole into staging memory and copying it into its
parameters (``HFEngine.load_state``); the figure is broadcast start to loaded by every node.

Usage: python ops/bench/weight_sync.py [--sizes 10,50,100,250,500] [--nodes 4] [--repeats 3]
       python ops/bench/weight_sync.py --transport collective [--sizes 10,100,1000]
       [--node-counts 1,2,4] [--bucket-mb 256]
Prints a table, then (last line) one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollcall.orchestrator import rayauth

TENSOR_PARAMS = 4 * 1024 * 1024  # 4M parameters per tensor (a 2048 x 2048 matrix)
CHUNK_BYTES = 64 * 1024 * 1024


def shapes(params: int) -> dict[str, tuple[int, ...]]:
    """Tensors of 2048 x 2048 and one remainder, ``params`` parameters in all."""
    out: dict[str, tuple[int, ...]] = {}
    full, rest = divmod(params, TENSOR_PARAMS)
    for i in range(full):
        out[f"layers.{i}.weight"] = (2048, 2048)
    if rest:
        out["tail.weight"] = (rest,)
    return out


def state_dict(params: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return {
        k: torch.randn(s, generator=g, dtype=torch.float32).to(torch.bfloat16)
        for k, s in shapes(params).items()
    }


def byte_view(t: Any) -> memoryview:
    """A tensor's memory as bytes (no copy)."""
    import torch

    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class Node:
    """A rollout node's side: parameters of the published shapes, loaded like the hf engine."""

    def __init__(self, params: int) -> None:
        import torch

        torch.set_num_threads(1)
        self.model = torch.nn.Module()
        for name, shape in shapes(params).items():
            mod = self.model
            *path, leaf = name.split(".")
            for p in path:
                if not hasattr(mod, p):
                    mod.add_module(p, torch.nn.Module())
                mod = getattr(mod, p)
            mod.register_parameter(
                leaf, torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16), False)
            )

    def load(self, location: str) -> float:
        """``HFEngine.load_weights``: the file read straight into the parameters."""
        from rollcall.workers.weights import load_into

        t0 = time.perf_counter()
        load_into(self.model, location)
        return time.perf_counter() - t0

    def load_state_dict(self, location: str) -> float:
        """The previous ``HFEngine.load_weights``: the file's tensors as a new state dict
        (``safetensors.torch.load_file``), then ``load_state_dict`` copies them over."""
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        state = load_file(str(Path(location) / "model.safetensors"))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        assert not missing and not unexpected
        del state
        return time.perf_counter() - t0

    def raw_read(self, path: str) -> float:
        """The bound's read: the file's bytes into the parameters' memory, plain IO."""
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            for p in self.model.parameters():
                view = byte_view(p.data)
                done = 0
                while done < len(view):
                    n = f.readinto(view[done : done + CHUNK_BYTES])
                    if not n:
                        raise EOFError(path)
                    done += n
        return time.perf_counter() - t0

    def receive(self, offer: dict[str, Any]) -> float:
        """The collective transport's node side: the version received whole, then copied
        into the parameters (``HFEngine.load_state``)."""
        from rollcall.workers import collective
        from rollcall.workers.weights import copy_into

        t0 = time.perf_counter()
        state = collective.receive(collective.Offer.from_json(offer), address="127.0.0.1")
        copy_into(self.model, state)
        return time.perf_counter() - t0

    def checksum(self) -> float:
        return float(sum(p.float().sum() for p in self.model.parameters()))


def raw_write(sd: dict[str, Any], path: Path) -> float:
    t0 = time.perf_counter()
    with path.open("wb", buffering=0) as f:
        for t in sd.values():
            view = byte_view(t)
            for i in range(0, len(view), CHUNK_BYTES):
                f.write(view[i : i + CHUNK_BYTES])
    return time.perf_counter() - t0


def measure(params: int, nodes: int, repeats: int, root: Path) -> dict[str, Any]:
    import ray

    from rollcall.workers.weights import publish

    sd = state_dict(params)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    node_actor: Any = ray.remote(num_cpus=0)(Node)
    actors: list[Any] = [node_actor.remote(params) for _ in range(nodes)]
    ray.get([a.checksum.remote() for a in actors])  # constructed
    runs = []
    for r in range(repeats):
        version = r + 1
        os.sync()  # both writes start with no dirty pages left over (the kernel would throttle)
        t0 = time.perf_counter()
        location = publish(sd, root / "weights", version, keep=2)
        t1 = time.perf_counter()
        loads = ray.get([a.load.remote(location) for a in actors])
        t2 = time.perf_counter()
        old = ray.get([a.load_state_dict.remote(location) for a in actors])
        raw = root / "raw.bin"
        os.sync()
        tw = time.perf_counter()
        w = raw_write(sd, raw)
        t3 = time.perf_counter()
        reads = ray.get([a.raw_read.remote(str(raw)) for a in actors])
        t4 = time.perf_counter()
        raw.unlink()
        runs.append(
            {
                "publish_s": t1 - t0,
                "load_s_max": max(loads),
                "total_s": t2 - t0,
                # the same publish with the previous loader
                "load_state_dict_s_max": max(old),
                "total_state_dict_s": (t1 - t0) + max(old),
                "raw_write_s": w,
                "raw_read_s_max": max(reads),
                "bound_s": (t3 - tw) + (t4 - t3),  # the raw write, then the nodes' reads
            }
        )
    expected = float(sum(t.float().sum() for t in sd.values()))
    got = float(ray.get(actors[0].checksum.remote()))  # the last raw read: the same bytes
    for a in actors:
        ray.kill(a)
    del sd
    med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
    return {
        "params_m": params / 1e6,
        "bytes": nbytes,
        "nodes": nodes,
        **med,
        "ratio": med["total_s"] / med["bound_s"],
        "ratio_state_dict": med["total_state_dict_s"] / med["bound_s"],
        "publish_gbps": nbytes / med["publish_s"] / 1e9,
        "bound_gbps": nbytes * (1 + nodes) / med["bound_s"] / 1e9,
        "checksum_ok": abs(got - expected) <= 1e-3 * max(1.0, abs(expected)),
        "runs": runs,
    }


def measure_collective(
    params: int, nodes: int, repeats: int, bucket_mb: float, rendezvous: Any, epoch: list[int]
) -> dict[str, Any]:
    import ray

    from rollcall.workers import collective

    sd = state_dict(params)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    node_actor: Any = ray.remote(num_cpus=0)(Node)
    actors: list[Any] = [node_actor.remote(params) for _ in range(nodes)]
    ray.get([a.checksum.remote() for a in actors])  # constructed
    runs = []
    for r in range(repeats):
        epoch[0] += 1
        offer = collective.Offer(
            version=r + 1,
            epoch=epoch[0],
            host=rendezvous.host,
            port=rendezvous.port,
            world=nodes + 1,
            rank=0,
            tensors=collective.describe(sd),
            bucket_bytes=int(bucket_mb * 2**20),
            timeout_s=120.0,
        )
        t0 = time.perf_counter()
        refs = [a.receive.remote(offer.for_rank(i + 1).to_json()) for i, a in enumerate(actors)]
        send_s = collective.send(rendezvous, offer, sd)
        loads = ray.get(refs)
        runs.append(
            {"send_s": send_s, "node_s_max": max(loads), "total_s": time.perf_counter() - t0}
        )
    expected = float(sum(t.float().sum() for t in sd.values()))
    got = float(ray.get(actors[-1].checksum.remote()))
    for a in actors:
        ray.kill(a)
    del sd
    med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
    return {
        "params_m": params / 1e6,
        "bytes": nbytes,
        "nodes": nodes,
        **med,
        "gbps_per_node": nbytes / med["total_s"] / 1e9,
        "checksum_ok": abs(got - expected) <= 1e-3 * max(1.0, abs(expected)),
        "runs": runs,
    }


def main_collective(args: Any) -> None:
    import ray

    from rollcall.workers import collective

    rayauth.configure_local()  # token authentication, as a job's local Ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    rendezvous = collective.Rendezvous("127.0.0.1")
    epoch = [0]
    rows = []
    try:
        print("params | GB (bf16) | nodes | send s | receive+copy s (max) | total s | GB/s | load")
        for size in (int(x) for x in args.sizes.split(",")):
            for nodes in (int(x) for x in args.node_counts.split(",")):
                r = measure_collective(
                    size * 1_000_000, nodes, args.repeats, args.bucket_mb, rendezvous, epoch
                )
                r["load"] = [round(x, 2) for x in os.getloadavg()]
                rows.append(r)
                print(
                    f"{size}M | {r['bytes'] / 1e9:.3f} | {nodes} | {r['send_s']:.3f} | "
                    f"{r['node_s_max']:.3f} | {r['total_s']:.3f} | {r['gbps_per_node']:.2f} | "
                    + "/".join(f"{x:g}" for x in r["load"]),
                    flush=True,
                )
    finally:
        ray.shutdown()
    print(json.dumps({"benchmark": "weight_sync", "transport": "collective", "rows": rows}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="10,50,100,250,500", help="millions of parameters")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where to publish (default: /tmp)")
    ap.add_argument("--transport", choices=["files", "collective"], default="files")
    ap.add_argument("--node-counts", default="1,2,4", help="collective: nodes per run")
    ap.add_argument("--bucket-mb", type=float, default=256.0, help="collective: bucket size")
    args = ap.parse_args()
    if args.transport == "collective":
        main_collective(args)
        return

    import ray

    rayauth.configure_local()  # token authentication, as a job's local Ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    root = Path(tempfile.mkdtemp(prefix="rc-wsync-", dir=args.dir or "/tmp"))
    rows = []
    try:
        print(
            "params | GB (bf16) | nodes | publish s | load s (max) | total s | raw write s | "
            "raw read s | bound s | total/bound | load_state_dict s | its total/bound | load"
        )
        for size in (int(x) for x in args.sizes.split(",")):
            # each size publishes versions 1, 2, ... into its own folder (a version older
            # than those already there would be pruned as soon as it is published)
            r = measure(size * 1_000_000, args.nodes, args.repeats, root / f"{size}m")
            shutil.rmtree(root / f"{size}m", ignore_errors=True)
            r["load"] = [round(x, 2) for x in os.getloadavg()]
            rows.append(r)
            print(
                f"{size}M | {r['bytes'] / 1e9:.3f} | {r['nodes']} | {r['publish_s']:.3f} | "
                f"{r['load_s_max']:.3f} | {r['total_s']:.3f} | {r['raw_write_s']:.3f} | "
                f"{r['raw_read_s_max']:.3f} | {r['bound_s']:.3f} | {r['ratio']:.2f}x | "
                f"{r['load_state_dict_s_max']:.3f} | {r['ratio_state_dict']:.2f}x | "
                + "/".join(f"{x:g}" for x in r["load"]),
                flush=True,
            )
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"benchmark": "weight_sync", "dtype": "bfloat16", "rows": rows}))


if __name__ == "__main__":
    main()
