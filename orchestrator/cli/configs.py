"""``rollcall config``: list and print the job configs shipped with the package.

They are ``configs/`` of the source tree (``rollcall/configs`` links to it), installed as
``rollcall/configs``, so an installed wheel has them without a clone: ``rollcall config show
quickstart > my.yaml``. The quickstart runs the shipped ``quickstart``."""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path
from typing import Annotated

import typer

from rollcall.orchestrator.cli.common import print_json
from rollcall.orchestrator.errors import NotFoundError

app = typer.Typer(
    help="The job configs shipped with rollcall: list them, print one to copy and edit.",
    no_args_is_help=True,
)


def shipped_dir() -> Path:
    """The folder of the shipped configs: ``rollcall/configs`` of the installed package (in
    the source tree a link to ``configs/``)."""
    return Path(str(resources.files("rollcall") / "configs"))


def shipped_names() -> list[str]:
    return sorted(p.stem for p in shipped_dir().glob("*.yaml"))


def shipped_config(name: str) -> Path:
    """The file of the shipped config ``name`` (``quickstart`` or ``quickstart.yaml``)."""
    stem = name.removesuffix(".yaml")
    path = shipped_dir() / f"{stem}.yaml"
    if "/" in stem or not path.is_file():
        names = ", ".join(shipped_names()) or "none"
        raise NotFoundError(f"no shipped config named {name!r}; the shipped configs: {names}")
    return path


@app.command("list")
def list_configs(
    json_out: Annotated[bool, typer.Option("--json", help="Print them as JSON.")] = False,
) -> None:
    """The shipped configs, one per line: the name (for `rollcall config show NAME`) and the
    file in the installed package."""
    rows = [(n, str(shipped_config(n))) for n in shipped_names()]
    if json_out:
        print_json([{"name": n, "path": p} for n, p in rows])
        return
    width = max((len(n) for n, _ in rows), default=0)
    for n, p in rows:
        sys.stdout.write(f"{n:<{width}}  {p}\n")


@app.command("show")
def show(
    name: Annotated[str, typer.Argument(help="A shipped config's name (`rollcall config list`).")],
) -> None:
    """Print a shipped config's YAML as it is in the package, comments included.

    `rollcall config show quickstart > my.yaml`, edit it, then `rollcall run my.yaml`. Paths in
    a config (tasks' agent and prompt files) are relative to the file that names them:
    smollm2-lora's point into the source tree's examples/."""
    sys.stdout.write(shipped_config(name).read_text())
