"""``rollcall --help`` must stay fast: the CLI module may not import heavy packages."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("sqlalchemy", "torch", "ray", "transformers", "alembic", "psycopg", "pydantic")


def test_cli_import_defers_heavy_packages() -> None:
    code = (
        "import sys, rollcall.orchestrator.cli\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_help_lists_command_groups() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rollcall.orchestrator.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    for group in ("db", "job", "task", "quickstart"):
        assert group in out.stdout
