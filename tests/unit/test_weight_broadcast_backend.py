"""``ops/gpu/weight_broadcast.py`` picks the backend and placement a machine can run: NCCL on
CUDA (rank 0 on a GPU of its own where there are two; on one GPU, one NCCL host per process,
since NCCL will not put two ranks of one group on the same device), gloo on the CPU."""

from __future__ import annotations

import os

import pytest

from ops.gpu.weight_broadcast import (
    ENGINE_HOST_ID,
    TRAINER_HOST_ID,
    choose_backend,
    nccl_host,
    placement,
    trainer_device,
)


@pytest.mark.parametrize(
    ("device", "asked", "gpus", "backend", "where", "rank0"),
    [
        ("cpu", "auto", 0, "gloo", "cpu", "cpu"),
        ("cpu", "gloo", 0, "gloo", "cpu", "cpu"),
        ("cuda", "auto", 1, "nccl", "shared", "cuda:0"),
        ("cuda", "auto", 2, "nccl", "separate", "cuda:1"),
        ("cuda", "nccl", 8, "nccl", "separate", "cuda:1"),
        ("cuda", "gloo", 1, "gloo", "host", "cuda:0"),
        ("cuda", "gloo", 4, "gloo", "host", "cuda:0"),
    ],
)
def test_a_backend_and_placement_the_machine_can_run(
    device: str, asked: str, gpus: int, backend: str, where: str, rank0: str
) -> None:
    assert choose_backend(device, asked) == (backend, None)
    assert placement(device, backend, gpus) == where
    assert trainer_device(where) == rank0


def test_nccl_is_refused_on_the_cpu() -> None:
    _, error = choose_backend("cpu", "nccl")
    assert error is not None and "gloo" in error


def test_the_engine_starts_as_another_nccl_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_HOSTID", TRAINER_HOST_ID)
    with nccl_host(ENGINE_HOST_ID):
        assert os.environ["NCCL_HOSTID"] == ENGINE_HOST_ID  # what vLLM's processes inherit
    assert os.environ["NCCL_HOSTID"] == TRAINER_HOST_ID
    with nccl_host(None):  # not sharing a GPU: left alone
        assert os.environ["NCCL_HOSTID"] == TRAINER_HOST_ID
