"""Folders written whole or not at all: a model build, the shipped model's copy, an import."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def replace_folder(path: Path, fill: Callable[[Path], object]) -> Path:
    """Put a folder written by ``fill`` at ``path`` and return ``path``.

    ``fill`` writes into a temporary sibling of ``path``, which is renamed into place only
    once ``fill`` returned: if it raises (or the process dies) ``path`` is as it was, and the
    temporary folder is removed. A folder already at ``path`` is moved aside first, put back
    if the rename fails, and removed once the new folder is in place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    old = path.with_name(f".{path.name}.{os.getpid()}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    try:
        fill(tmp)
        if path.exists():
            path.rename(old)
        try:
            tmp.rename(path)
        except OSError:
            if old.exists():
                old.rename(path)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    return path
