"""``python -I -S probe_main.py --probe``: ``protections.main`` in a bare interpreter (``probe``
runs this file by its path: no site-packages, no environment, no working directory on the
path).

Standard library only: the sandbox's package is imported by its folder's name (``sandbox``),
from the folder above it, searched after the standard library; its modules import one another
relatively and nothing of rollcall's.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

if __name__ == "__main__" and sys.argv[1:] == ["--probe"]:
    here = Path(__file__).resolve().parent
    sys.path.append(str(here.parent))
    importlib.import_module(f"{here.name}.protections").main()
