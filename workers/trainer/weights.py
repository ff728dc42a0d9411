"""Versioned weights on a file system: the trainer publishes, rollout nodes load.

Version v lives in ``ROOT/v{v:06d}/model.safetensors``. A version is written into a hidden
temporary folder and renamed into place, so a reader sees a complete version or none. The last
``keep`` versions stay (a node may still be loading one); older ones are removed. On one machine
ROOT is a local folder; across Ray nodes it must be shared storage (NFS, a mounted bucket).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

WEIGHTS_FILE = "model.safetensors"


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:06d}"


def publish(state_dict: dict[str, Any], root: Path, version: int, *, keep: int = 3) -> str:
    from safetensors.torch import save_file

    return publish_with(
        lambda path: save_file(state_dict, str(path), metadata={"version": str(version)}),
        root,
        version,
        keep=keep,
    )


def publish_with(write: Callable[[Path], None], root: Path, version: int, *, keep: int = 3) -> str:
    """``publish`` for any writer: ``write(path)`` writes the weights file at ``path``."""
    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, version)
    tmp = root / f".v{version:06d}.{os.getpid()}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    write(tmp / WEIGHTS_FILE)
    if final.exists():  # a replayed step republishes its version
        shutil.rmtree(final)
    tmp.rename(final)
    versions = sorted(p for p in root.glob("v*") if p.is_dir())
    for old in versions[: max(0, len(versions) - keep)]:
        shutil.rmtree(old, ignore_errors=True)
    return str(final)


def published_versions(root: Path) -> list[int]:
    return sorted(int(p.name[1:]) for p in root.glob("v*") if p.is_dir() and p.name[1:].isdigit())
