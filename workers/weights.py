"""Versioned weights on a file system: the trainer publishes, rollout nodes load.

Version v lives in ``ROOT/v{v:06d}/model.safetensors`` (with LoRA, the adapter alone:
``adapter_model.safetensors`` and ``adapter_config.json``, ``rollcall.workers.lora``). A
version is written into a hidden temporary folder and renamed into place, so a reader sees a
complete version or none. The last ``keep`` versions stay (a node may still be loading one);
older ones are removed. On one machine ROOT is a local folder; across Ray nodes it must be
shared storage (NFS, a mounted bucket).

Both sides move each byte once: ``publish`` hands safetensors the tensors' memory (it writes
from their pointers), and ``load_into`` reads the file straight into the model's parameters
(``readinto`` at each tensor's offset) instead of building a state dict and copying it over.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollcall.workers import lora as adapters
from rollcall.workers.lora import ADAPTER_FILE  # a LoRA version's file

WEIGHTS_FILE = "model.safetensors"
PIN_FILE = ".pinned"  # in a version's folder: pruning leaves the version alone (``pin``)


def weights_file(location: str | Path) -> Path:
    """The file a published version's tensors are in: its adapter (LoRA) or its weights."""
    adapter = Path(location) / ADAPTER_FILE
    return adapter if adapter.is_file() else Path(location) / WEIGHTS_FILE


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:06d}"


def publish(
    state_dict: dict[str, Any],
    root: Path,
    version: int,
    *,
    keep: int = 3,
    metadata: dict[str, str] | None = None,
) -> str:
    """``metadata``: more string entries for the file's header (besides ``version``)."""
    from safetensors.torch import save_file

    meta = {**(metadata or {}), "version": str(version)}
    return publish_with(
        lambda path: save_file(state_dict, str(path), metadata=meta),
        root,
        version,
        keep=keep,
    )


def publish_adapter(
    state: dict[str, Any],
    config: dict[str, Any],
    root: Path,
    version: int,
    *,
    keep: int = 3,
    metadata: dict[str, str] | None = None,
) -> str:
    """A LoRA version: only the adapter (``state``: the adapter parameters by name) and its
    peft config (``config``: ``lora.config_dict``), in the version's folder."""
    meta = {**(metadata or {}), "version": str(version)}
    return publish_with(
        lambda path: adapters.write_adapter(state, path.parent, config, meta),
        root,
        version,
        keep=keep,
        file=ADAPTER_FILE,
    )


def publish_with(
    write: Callable[[Path], None],
    root: Path,
    version: int,
    *,
    keep: int = 3,
    file: str = WEIGHTS_FILE,
) -> str:
    """``publish`` for any writer: ``write(path)`` writes the version's ``file`` at ``path``
    (and may write more files beside it)."""
    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, version)
    tmp = root / f".v{version:06d}.{os.getpid()}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    write(tmp / file)
    if final.exists():  # a replayed step republishes its version
        shutil.rmtree(final)
    tmp.rename(final)
    versions = sorted(p for p in root.glob("v*") if p.is_dir())
    for old in versions[: max(0, len(versions) - keep)]:
        if not (old / PIN_FILE).exists():
            shutil.rmtree(old, ignore_errors=True)
    return str(final)


def pin(location: str | Path) -> None:
    """Keep a published version past ``keep`` (an evaluation queued for it) until ``unpin``;
    the first publication after that removes it if it is old."""
    with contextlib.suppress(OSError):  # already pruned: the evaluation will say so
        (Path(location) / PIN_FILE).touch()


def unpin(location: str | Path) -> None:
    (Path(location) / PIN_FILE).unlink(missing_ok=True)


def unpin_all(root: Path) -> None:
    """A driver's start: the pins of one that died are nobody's now."""
    for p in root.glob(f"v*/{PIN_FILE}"):
        p.unlink(missing_ok=True)


def wait_published(location: str | Path, timeout_s: float = 120.0) -> bool:
    """Wait until the version at ``location`` is in place (a file written in the background,
    collective transport); whether it is."""
    deadline = time.monotonic() + timeout_s
    while not weights_file(location).is_file():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def read_metadata(location: str | Path) -> dict[str, str]:
    """The string entries of a published version's header (``version``, ``updates``)."""
    with weights_file(location).open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(size)).get("__metadata__") or {}
    return {str(k): str(v) for k, v in meta.items()}


def published_versions(root: Path) -> list[int]:
    return sorted(int(p.name[1:]) for p in root.glob("v*") if p.is_dir() and p.name[1:].isdigit())


# safetensors dtype names -> torch dtype attribute names
_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip
_CHUNK_BYTES = 64 * 1024 * 1024


def read_header(f: Any) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (name -> dtype, shape, data offsets) and where data starts."""
    size = int.from_bytes(f.read(8), "little")
    header: dict[str, Any] = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def _readinto(f: Any, view: memoryview) -> None:
    done = 0
    while done < len(view):
        n = f.readinto(view[done : done + _CHUNK_BYTES])
        if not n:
            raise OSError(f"{f.name}: the file ends before its tensors do")
        done += n


def load_into(model: Any, location: str | Path) -> None:
    """Load a published version into ``model`` (a torch module) in place. A tensor whose dtype,
    shape and device match its parameter is read straight into the parameter's memory; any
    other goes through a temporary and ``copy_`` (a dtype or device change). Raises
    ``ValueError`` naming the keys when the file does not fit the model (a key the model lacks,
    or a parameter the file lacks other than a tied ``lm_head``), before changing anything;
    ``OSError`` when the version is gone."""
    import torch

    path = Path(location) / WEIGHTS_FILE
    targets = model.state_dict()  # detached tensors sharing the parameters' memory
    with path.open("rb", buffering=0) as f:
        header, base = read_header(f)
        _check_fits(header, targets, str(path))
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            start, end = info["data_offsets"]
            dst = targets[name]
            dtype = getattr(torch, _DTYPES[info["dtype"]])
            f.seek(base + start)
            direct = (
                dst.dtype == dtype
                and list(dst.shape) == list(info["shape"])
                and dst.device.type == "cpu"
                and dst.is_contiguous()
            )
            if direct:
                _readinto(f, memoryview(dst.view(torch.uint8).numpy()).cast("B"))
                continue
            buf = bytearray(end - start)
            _readinto(f, memoryview(buf))
            src = torch.frombuffer(buf, dtype=dtype).reshape(info["shape"])
            with torch.no_grad():
                dst.copy_(src)


def _check_fits(names: Any, targets: dict[str, Any], where: str) -> None:
    """Raise ``ValueError`` naming the keys unless ``names`` are exactly the model's
    parameters (a tied ``lm_head`` may be absent)."""
    unexpected = sorted(k for k in names if k not in targets)
    missing = sorted(k for k in targets if k not in names and "lm_head" not in k)
    if unexpected or missing:
        raise ValueError(f"{where} does not fit the model: {(unexpected + missing)[:5]}")


def copy_into(model: Any, state: dict[str, Any], where: str = "the version received") -> None:
    """``load_into`` for tensors already in memory (a broadcast's): each one copied into its
    parameter (a dtype change on the way), after the same fit check, before changing anything."""
    import torch

    targets = model.state_dict()
    _check_fits(state, targets, where)
    with torch.no_grad():
        for name, src in state.items():
            targets[name].copy_(src)
