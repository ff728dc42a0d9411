"""Loading a job config: YAML files, dotted overrides, and validation errors as one line each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rollcall.orchestrator.config.root import RollcallConfig
from rollcall.orchestrator.errors import UserError


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per problem: ``source: field.path: message``."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key; remove it or check its spelling"
        lines.append(f"{source}: {loc}: {msg}")
    return "; ".join(lines)


def read_yaml_mapping(path: Path, what: str) -> dict[str, Any]:
    """Read a YAML file that must hold a mapping; errors name the file and the fix."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"{what} file {path} does not exist; pass an existing YAML file") from None
    except OSError as e:
        raise UserError(f"{what} file {path} cannot be read ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{what} file {path} is not valid YAML{where}; fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(
            f"{what} file {path} must hold a mapping of keys to values, not a {type(data).__name__}"
        )
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides; values are parsed as YAML scalars (no code runs)."""
    out: dict[str, Any] = dict(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UserError(f"override {item!r} must look like dotted.key=value")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            raise UserError(f"override {item!r} has a value that is not valid YAML") from None
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        node[parts[-1]] = value
    return out


def _relative_to(folder: Path, data: dict[str, Any]) -> dict[str, Any]:
    """Agent tasks' file paths (``tasks[].agent`` as ``FILE.py:function``, ``tasks[].prompts``
    ``path``) are relative to the config file's folder: made absolute here."""
    tasks = data.get("tasks")
    if not isinstance(tasks, list):
        return data
    out = []
    for task in tasks:
        if isinstance(task, dict):
            task = dict(task)
            agent = task.get("agent")
            if isinstance(agent, str):
                where, sep, name = agent.rpartition(":")
                if sep and where.endswith(".py") and not Path(where).expanduser().is_absolute():
                    task["agent"] = f"{folder / where}:{name}"
            prompts = task.get("prompts")
            if isinstance(prompts, dict) and isinstance(prompts.get("path"), str):
                file = Path(prompts["path"]).expanduser()
                if not file.is_absolute():
                    task["prompts"] = {**prompts, "path": str(folder / file)}
        out.append(task)
    return {**data, "tasks": out}


def load_config(path: Path, overrides: list[str] | None = None) -> RollcallConfig:
    data = apply_overrides(read_yaml_mapping(path, "config"), overrides or [])
    data = _relative_to(path.expanduser().resolve().parent, data)
    try:
        return RollcallConfig.model_validate(data)
    except ValidationError as e:
        raise UserError(format_validation_error(e, str(path))) from None


def read_chat_template(path: str | None) -> str | None:
    """The source of ``model.chat_template`` (``None``: the tokenizer's own template)."""
    if path is None:
        return None
    file = Path(path).expanduser()
    try:
        return file.read_text()
    except OSError as e:
        raise UserError(
            f"model.chat_template {file} cannot be read ({e.strerror or e}); give a Jinja file"
        ) from None
