"""The ``vllm`` engine adapter on real vLLM (CPU build): rollout and trainer agree (the on-policy
importance weight is 1 up to numerics), in-place weight loads that refuse a corrupt or incomplete
file and serve nothing from half-loaded weights, a bf16 publication served by a float32 engine, a
dead EngineCore that becomes ``EngineFailure``, and no vLLM process left behind; and
``ops/gpu/vllm_smoke.py``'s checks (the adapter's behaviour log-probs against the trainer's
recomputation). One engine for the module (each start costs 20-55 s here): the smoke check's, in
float32, started as the script starts it on the model it builds; its tests run in this file's
order, the ones that need the model's own weights (version 0) first, the one that kills its
EngineCore last. (test_vllm_agreement.py's and test_vllm_smoke.py's tests, merged here.)"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ops.gpu import vllm_smoke
from rollcall.orchestrator.config import VLLMEngineConfig
from rollcall.workers.episode.engine import EngineFailure, GenerationRequest
from tests.support.agreement import assert_agree, describe, onpolicy_step_metrics

pytestmark = pytest.mark.timeout(900)

T = 0.7


def _trainer_logprobs(model_dir: Path, state: dict[str, Any] | None, ids: list[int]) -> Any:
    """The trainer's own recomputation of ``ids``' log-probs at temperature ``T``."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollcall.workers.trainer.forward import token_logprobs
    from rollcall.workers.trainer.packing import pack

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state, strict=False)
        model.tie_weights()
    with torch.no_grad():
        return token_logprobs(model, pack([ids], device="cpu"), temperature=T)[0]


def _max_err(
    model_dir: Path, state: dict[str, Any] | None, req: GenerationRequest, gen: Any
) -> float:
    ids = req.prompt_ids + gen.token_ids
    lp = _trainer_logprobs(model_dir, state, ids)
    n = len(req.prompt_ids)
    return max(abs(float(lp[n + i]) - b) for i, b in enumerate(gen.logprobs))


# ``python ops/gpu/vllm_smoke.py --device cpu --loops 4``: float32 (vLLM on CPU serves float32
# when asked; dtype "auto" serves a float32 model in bf16: on-policy mean log-weight 5.7e-5)
SMOKE = argparse.Namespace(
    device="cpu", dtype="float32", loops=4, gpu_memory_utilization=0.2, keep=None
)


@pytest.fixture(scope="module")
def smoke_work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The smoke check's folder, its model in ``model/`` built as ``vllm_smoke.run`` builds it
    (hidden 128, 4 heads of 32, wide init, seed 0; ``run`` builds it again: the same bytes)."""
    from rollcall.workers.tiny_model import build_model, build_tokenizer

    work = tmp_path_factory.mktemp("smoke")
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, hidden=128, layers=2, heads=4, init_std=0.1, seed=0)
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    return work


@pytest.fixture(scope="module")
def model_dir(smoke_work: Path) -> Path:
    return smoke_work / "model"


@pytest.fixture(scope="module")
def vllm_engine(model_dir: Path) -> Iterator[Any]:
    engine = vllm_smoke.start_engine(SMOKE, model_dir)
    try:
        yield engine
    finally:
        engine.close()


class _Handed:
    """The module's engine as ``vllm_smoke.run`` gets it from ``start_engine``: its ``health``
    counts from the handover (``run`` checks that it counts every token ``run`` generated), and
    its ``close`` is left to the module's fixture."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        h = engine.health()
        self._tokens, self._requests = h.tokens_generated, h.requests

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def health(self) -> Any:
        h = self._engine.health()
        return dataclasses.replace(
            h,
            tokens_generated=h.tokens_generated - self._tokens,
            requests=h.requests - self._requests,
        )

    def close(self) -> None:
        pass


def _weights(model_dir: Path, seed: int) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    torch.manual_seed(seed)
    state = load_file(str(model_dir / "model.safetensors"))
    state.pop("lm_head.weight", None)  # tied: the trainer publishes without it
    return {k: (v + 0.05 * torch.randn_like(v)).contiguous() for k, v in state.items()}


# At 1.0 (the job's) and 0.7: only there do raw and temperature-scaled log-probs differ. The
# engine still serves version 0 (the model's own weights, as the fresh trainer's).
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_engine_onpolicy_is_weight_is_one(
    vllm_engine: Any, model_dir: Path, ray_local: Any, temperature: float
) -> None:
    assert vllm_engine.version == 0
    m = onpolicy_step_metrics(vllm_engine, model_dir, temperature=temperature)
    print(f"vllm engine (cpu, float32), tiny, T {temperature}: {describe(m)}")
    assert_agree(m)


def test_the_vllm_smoke_check_passes_on_cpu(
    vllm_engine: Any, smoke_work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ops/gpu/vllm_smoke.py --device cpu``'s checks (its ``run``, on this module's engine,
    still at version 0): every behaviour log-prob checked against the trainer's own
    recomputation (float32: within 1e-4 per token), in agent loops, long generations and after
    a weight load (the prefix cache reset); ``run`` loads version 1."""
    assert vllm_smoke.absent("cpu") is None and vllm_engine.version == 0

    def start_engine(args: argparse.Namespace, model: Path, max_model_len: int = 2048) -> Any:
        assert (vars(args), model, max_model_len) == (vars(SMOKE), smoke_work / "model", 2048)
        return _Handed(vllm_engine)

    monkeypatch.setattr(vllm_smoke, "start_engine", start_engine)
    monkeypatch.setattr(vllm_smoke, "DEVICE", "cpu")  # main()'s --device cpu
    report = vllm_smoke.run(SMOKE, smoke_work)
    assert report["ok"], report
    figures = report["figures"]
    assert report["dtype"] == "float32" and report["tolerance"] == 1e-4
    for part in ("agent_loops", "long", "after_load"):
        assert figures[part]["max_abs_err"] < 1e-4, figures
    assert vllm_engine.version == 1


def test_tokens_count_as_vllm_generates_them_not_when_the_call_returns(vllm_engine: Any) -> None:
    """The node's liveness (``control_plane.progress_timeout_s``) reads the engine's token
    count: it grows while a long turn is generated, as the hf engine's does (per step). Before,
    vLLM's tokens counted once the whole call returned, and a node in a long turn showed
    progress only through its upkeep's one-token probes."""
    before = vllm_engine.health().tokens_generated
    reqs = [GenerationRequest([5, 6, 7, 9 + i], 400, 1.0, seed=i) for i in range(4)]
    seen: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(vllm_engine.health().tokens_generated - before)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        gens = vllm_engine.generate(reqs)
    finally:
        done.set()
        watcher.join()
    total = vllm_engine.health().tokens_generated - before
    assert (
        total == sum(len(g.token_ids) for g in gens)
        and max(map(len, (g.token_ids for g in gens))) > 64
    )
    during = sorted({n for n in seen if 0 < n < total})
    assert during, f"the count went from 0 to {total} at once (seen: {sorted(set(seen))})"


def test_a_failed_load_serves_nothing_until_a_later_version_loads(
    vllm_engine: Any, model_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from rollcall.workers.weights import publish

    # the smoke check loaded its own weights: the model's own ones again, as version v
    v = vllm_engine.version + 1
    own = load_file(str(model_dir / "model.safetensors"))
    own.pop("lm_head.weight", None)
    vllm_engine.load_weights(v, publish(own, tmp_path, v))
    reqs = [GenerationRequest([5, 6, 7, 8 + i], 16, T) for i in range(3)]
    before = vllm_engine.generate(reqs)
    assert all(g.version == v for g in before)
    assert _max_err(model_dir, None, reqs[0], before[0]) < 1e-4

    good = _weights(model_dir, 1)
    vllm_engine.load_weights(v + 1, publish(good, tmp_path, v + 1))
    assert vllm_engine.version == v + 1
    gen = vllm_engine.generate(reqs[:1])[0]
    assert gen.version == v + 1
    assert _max_err(model_dir, good, reqs[0], gen) < 1e-4  # the new weights, tied head too

    corrupt = tmp_path / f"v{v + 2:06d}"
    corrupt.mkdir()
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file" * 64)
    with pytest.raises(Exception, match="header"):
        vllm_engine.load_weights(v + 2, str(corrupt))
    assert vllm_engine.version == v + 1
    with pytest.raises(EngineFailure, match=f"version {v + 2} failed") as refused:
        vllm_engine.generate(reqs)
    assert not refused.value.fatal
    vllm_engine.probe()  # the engine itself still works (the node's liveness probe)

    incomplete = dict(good)
    incomplete.pop("model.layers.1.mlp.down_proj.weight")
    with pytest.raises(Exception, match="down_proj"):
        vllm_engine.load_weights(v + 3, publish(incomplete, tmp_path, v + 3))
    with pytest.raises(EngineFailure):
        vllm_engine.generate(reqs)

    with pytest.raises(FileNotFoundError):
        vllm_engine.load_weights(v + 4, str(tmp_path / f"v{v + 4:06d}"))

    newer = _weights(model_dir, 5)
    vllm_engine.load_weights(v + 5, publish(newer, tmp_path, v + 5))
    after = vllm_engine.generate(reqs)
    assert all(g.version == v + 5 for g in after)
    assert _max_err(model_dir, newer, reqs[0], after[0]) < 1e-4
    assert vllm_engine.failure() is None


def test_vllm_loads_bf16_published_weights_into_its_float32_model(
    vllm_engine: Any, model_dir: Path, tmp_path: Path
) -> None:
    """A bf16 trainer's publication (``trainer.precision: bf16``) loads into a float32 vLLM
    engine: it then samples from exactly those weights (upcast), as the trainer scores them."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rollcall.workers.trainer.forward import token_logprobs
    from rollcall.workers.trainer.packing import pack
    from rollcall.workers.weights import publish

    torch.manual_seed(3)
    state = load_file(str(model_dir / "model.safetensors"))
    state.pop("lm_head.weight", None)  # tied: the trainer publishes without it
    bf16 = {k: (v + 0.05 * torch.randn_like(v)).to(torch.bfloat16) for k, v in state.items()}
    version = vllm_engine.version + 1  # the module's engine has loaded others before
    vllm_engine.load_weights(version, publish(bf16, tmp_path, version))
    req = GenerationRequest([5, 6, 7, 8, 9], 24, 1.0)
    (gen,) = vllm_engine.generate([req])
    assert gen.version == version

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.load_state_dict({k: v.float() for k, v in bf16.items()}, strict=False)
    model.tie_weights()
    with torch.no_grad():
        lp = token_logprobs(model, pack([req.prompt_ids + gen.token_ids], device="cpu"))[0]
    n = len(req.prompt_ids)
    err = max(abs(float(lp[n + i]) - b) for i, b in enumerate(gen.logprobs))
    print(f"vllm float32 engine on bf16-published weights: max log-prob error {err:.2e}")
    assert err < 1e-4


def test_a_dead_engine_core_is_an_engine_failure_and_leaves_no_process(
    vllm_engine: Any,
) -> None:
    from rollcall.orchestrator.engineprocs import all_engine_processes
    from rollcall.orchestrator.procfs import alive

    procs = set(vllm_engine.engine_pids())
    core = [vllm_engine.processes["engine_core"]]
    assert core[0] in procs and len(procs) >= 2, (vllm_engine.processes, all_engine_processes())
    sockets = _bound_socket_files({os.getpid(), *procs})
    assert sockets, "vLLM's processes talk over ZMQ ipc sockets, files on disk"

    def kill() -> None:
        time.sleep(0.5)
        os.kill(core[0], signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(EngineFailure, match="EngineCore died") as died:
        vllm_engine.generate([GenerationRequest([1, 2, 3], 4000, 1.0) for _ in range(4)])
    assert died.value.fatal and time.monotonic() - t0 < 30
    assert "EngineCore died" in (vllm_engine.failure() or "")
    with pytest.raises(EngineFailure):  # for good
        vllm_engine.generate([GenerationRequest([1, 2], 2, 1.0)])
    vllm_engine.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(map(alive, procs)):
        time.sleep(0.2)
    assert not any(map(alive, procs))
    # a SIGKILLed EngineCore never unlinks its sockets: each restart of a long job left its
    # files in /tmp (the soak found thousands); the engine keeps them in a folder it removes
    left = [path for path in sockets if os.path.lexists(path)]
    assert not left, left


def _bound_socket_files(pids: set[int]) -> set[str]:
    """The paths of the Unix sockets bound to a file that ``pids`` hold open (/proc)."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = str(fd.readlink())
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    paths = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes and fields[7].startswith("/"):
            paths.add(fields[7])
    return paths


def test_the_engine_refuses_a_mismatched_build_or_head_size(tmp_path: Path) -> None:
    from rollcall.workers.rollout.engines.vllm import EngineUnavailable, VLLMEngine
    from rollcall.workers.tiny_model import build_tiny

    model = build_tiny(tmp_path / "m", heads=4)  # head size 16
    with pytest.raises(EngineUnavailable, match="set device: cpu"):
        VLLMEngine(model, VLLMEngineConfig(device="cuda"))
    with pytest.raises(EngineUnavailable, match=r"heads of size 16.*model init"):
        VLLMEngine(model, VLLMEngineConfig(device="cpu"))
