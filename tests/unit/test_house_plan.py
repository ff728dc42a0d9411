"""The house plan's rules that a linter does not check (docs/architecture.md, Layout): no
production module over 600 lines, and an import of rollcall's own modules inside a function
only in the CLI, which keeps ``rollcall --help`` free of SQLAlchemy and pydantic
(``test_cli_startup.py``). Elsewhere such an import hides a dependency from import-linter's
layers contract and from the reader; a module that needs torch, vLLM or Ray at import time
defers them itself."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("orchestrator", "workers", "tasks", "migrations")
OWN = ("rollcall", *PACKAGES)
MAX_LINES = 600


def _modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _own_imports_in_functions(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom) and sub.module:
                    names = [sub.module]
                elif isinstance(sub, ast.Import):
                    names = [a.name for a in sub.names]
                else:
                    continue
                found += [(sub.lineno, n) for n in names if n.split(".")[0] in OWN]
    return sorted(set(found))


def test_no_production_module_is_over_600_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_own_modules_are_imported_at_the_top_outside_the_cli() -> None:
    found = {
        f"{p.relative_to(ROOT)}:{line}": name
        for p in _modules()
        if "orchestrator/cli" not in p.as_posix()
        for line, name in _own_imports_in_functions(ast.parse(p.read_text()))
    }
    assert not found, found


def test_the_check_sees_an_import_in_a_function() -> None:
    tree = ast.parse(
        "import os\n"
        "def f():\n"
        "    import json\n"
        "    from rollcall.workers import weights\n"
        "    async def g():\n"
        "        import workers.lora\n"
    )
    assert _own_imports_in_functions(tree) == [(4, "rollcall.workers"), (6, "workers.lora")]
