"""``ops/gpu/weight_broadcast.py`` picks the backend a machine can run, and refuses NCCL on one
GPU with the reason (NCCL will not put two ranks of one group on the same device)."""

from __future__ import annotations

import pytest

from ops.gpu.weight_broadcast import choose_backend, trainer_device


@pytest.mark.parametrize(
    ("device", "asked", "gpus", "backend"),
    [
        ("cpu", "auto", 0, "gloo"),
        ("cpu", "gloo", 0, "gloo"),
        ("cuda", "auto", 1, "gloo"),
        ("cuda", "auto", 2, "nccl"),
        ("cuda", "gloo", 4, "gloo"),
        ("cuda", "nccl", 2, "nccl"),
    ],
)
def test_a_backend_the_machine_can_run(device: str, asked: str, gpus: int, backend: str) -> None:
    assert choose_backend(device, asked, gpus) == (backend, None)


def test_nccl_is_refused_on_one_gpu_and_on_the_cpu() -> None:
    _, one_gpu = choose_backend("cuda", "nccl", 1)
    assert one_gpu is not None and "Duplicate GPU detected" in one_gpu and "gloo" in one_gpu
    _, cpu = choose_backend("cpu", "nccl", 0)
    assert cpu is not None and "gloo" in cpu


def test_nccl_puts_the_trainer_on_a_gpu_of_its_own() -> None:
    assert trainer_device("cuda", "nccl") == "cuda:1"  # the engine holds GPU 0
    assert trainer_device("cuda", "gloo") == "cuda:0"
    assert trainer_device("cpu", "gloo") == "cpu"
