"""``agent``: a task whose episodes are played by the user's own agent function.

The user writes ``async def rollout(ctx, prompt) -> Outcome`` (the API: ``import rollcall``,
the manual: docs/agents.md) and names it in the config with a prompt source::

    tasks:
      - name: lookup
        agent: examples/lookup/agent.py:rollout      # or "my_pkg.my_agent:rollout"
        prompts: {path: examples/lookup/prompts.jsonl, key: question}

This module is the plugin side of it: the spec (which function, which prompts, tool and call
settings), the prompt streams and the checks that refuse bad input with one sentence before
anything is written (a missing module or function, a function of the wrong shape, a prompt file
with a bad row). It plays nothing itself: a rollout node sees ``AgentTask`` and runs the
function through ``rollcall.workers.episode`` (the model's chat template, the engine, durable
replay).

Prompt sources are deterministic by index: the ``index``-th training prompt is the
``index mod n``-th row of the training split (files read in sorted order, rows in file order),
so a restart that resumes from the persisted cursor neither repeats nor skips a prompt; a row
is held out by its ``key`` column (or the whole row) as the built-in tasks split theirs
(``rollcall.tasks.base.held_out``).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import importlib
import importlib.util
import inspect
import json
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollcall.tasks.base import TaskSpec, held_out


class AgentSpecError(ValueError):
    """An agent task that cannot run: the message is one sentence saying what and where."""


# -- the agent function ---------------------------------------------------------------------


def _split_ref(ref: str) -> tuple[str, str]:
    where, sep, name = ref.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise AgentSpecError(
            f"agent {ref!r} must be 'package.module:function' or 'path/to/file.py:function'"
        )
    return where, name


def resolve_ref(ref: str) -> str:
    """``ref`` with a file path made absolute (nodes may run in another directory)."""
    where, name = _split_ref(ref)
    if where.endswith(".py"):
        return f"{Path(where).expanduser().resolve()}:{name}"
    return ref


_IMPORT_LOCK = threading.Lock()
AGENT_FILE_MODULE = "rollcall_agent_"  # the prefix of the modules agent files are loaded as


def _module(where: str, ref: str) -> Any:
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise AgentSpecError(f"agent {ref!r}: no such file {where}")
        # one module per file, named by its path, so the same file is one module in a process
        digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
        name = f"{AGENT_FILE_MODULE}{path.stem}_{digest}"
        with _IMPORT_LOCK:  # threads validating at once must not see a half-run module
            return _file_module(name, path, where, ref)
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        raise AgentSpecError(f"agent {ref!r}: no module named {e.name!r}") from e
    except Exception as e:
        raise AgentSpecError(
            f"agent {ref!r}: importing {where} raised {type(e).__name__}: {e}"
        ) from e


def _file_module(name: str, path: Path, where: str, ref: str) -> Any:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:  # pragma: no cover - a .py file always has one
        raise AgentSpecError(f"agent {ref!r}: {where} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    # its sibling modules import as under `python agent.py`: its folder first on sys.path (every
    # process that loads it: the driver, each node, the evaluator). rollcall's own packages are
    # under `rollcall.`, so a sibling named `tasks` or `workers` is the user's
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise AgentSpecError(
            f"agent {ref!r}: importing {where} raised {type(e).__name__}: {e}"
        ) from e
    return module


def load_agent(ref: str) -> Callable[..., Any]:
    """The agent function named by ``ref``, checked: an ``async def`` taking ``(ctx, prompt)``."""
    where, name = _split_ref(ref)
    module = _module(where, ref)
    fn = getattr(module, name, None)
    if fn is None:
        raise AgentSpecError(f"agent {ref!r}: {where} has no function {name!r}")
    target = fn.__call__ if not inspect.isroutine(fn) and callable(fn) else fn
    if not inspect.iscoroutinefunction(target):
        raise AgentSpecError(
            f"agent {ref!r} must be an async function, 'async def {name}(ctx, prompt)'"
        )
    try:
        sig = inspect.signature(fn)
        sig.bind(object(), {})
    except (TypeError, ValueError):
        params = ", ".join(inspect.signature(fn).parameters)
        raise AgentSpecError(
            f"agent {ref!r} must take two arguments (ctx, prompt); it takes ({params})"
        ) from None
    return fn  # type: ignore[no-any-return,unused-ignore]


# -- prompt sources ---------------------------------------------------------------------------


class PromptSource(BaseModel):
    """Where an agent task's prompts come from: one of ``path`` (JSONL or Parquet files, a path
    or a glob) or ``dataset`` (a Hugging Face ``datasets`` folder or name, when ``datasets`` is
    installed). Each row is one prompt, a JSON object given to the agent as it is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str | None = Field(
        default=None, description="a .jsonl or .parquet file, or a glob of them"
    )
    dataset: str | None = Field(
        default=None,
        description="a `datasets` folder (save_to_disk) or a name load_dataset finds locally",
    )
    split: str = Field(default="train", description="the dataset's split (with dataset)")
    key: str | None = Field(
        default=None,
        description="the column that decides the held-out split (default: the whole row)",
    )
    held_out_per_mille: int = Field(
        default=100, ge=0, le=1000, description="rows per thousand held out for evaluation"
    )

    @model_validator(mode="after")
    def _one(self) -> PromptSource:
        if (self.path is None) == (self.dataset is None):
            raise ValueError("prompts needs exactly one of path or dataset")
        return self

    @field_validator("path")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        return None if v is None else str(Path(v).expanduser().resolve())


def _files(pattern: str) -> list[Path]:
    found = sorted(Path(p) for p in glob.glob(pattern)) if glob.has_magic(pattern) else []  # noqa: PTH207
    if not glob.has_magic(pattern):
        if not Path(pattern).is_file():
            raise AgentSpecError(f"prompts: no such file {pattern}")
        found = [Path(pattern)]
    if not found:
        raise AgentSpecError(f"prompts: no file matches {pattern}")
    for f in found:
        if f.suffix not in (".jsonl", ".parquet"):
            raise AgentSpecError(f"prompts: {f} is neither .jsonl nor .parquet")
    return found


def _jsonl_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise AgentSpecError(f"prompts: {path} line {n} is not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise AgentSpecError(
                    f"prompts: {path} line {n} is a JSON {type(row).__name__}, not an object"
                )
            rows.append(row)
    return rows


def _parquet_rows(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise AgentSpecError(
            f"prompts: reading {path} needs pyarrow (pip install 'rollcall[agents]')"
        ) from None
    try:
        return [dict(r) for r in pq.read_table(path).to_pylist()]
    except Exception as e:
        raise AgentSpecError(f"prompts: {path} is not a readable Parquet file ({e})") from e


def _dataset_rows(name: str, split: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise AgentSpecError(
            "prompts.dataset needs the datasets package (pip install datasets)"
        ) from None
    try:
        if Path(name).is_dir() and (Path(name) / "dataset_dict.json").exists():
            data = datasets.load_from_disk(name)[split]
        elif Path(name).is_dir() and (Path(name) / "dataset_info.json").exists():
            data = datasets.load_from_disk(name)
        else:
            data = datasets.load_dataset(name, split=split)
    except Exception as e:
        raise AgentSpecError(
            f"prompts: dataset {name!r} (split {split!r}) cannot be loaded ({e})"
        ) from e
    return [dict(r) for r in data]


def _canonical(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


@functools.lru_cache(maxsize=16)
def _load(source: PromptSource, stamp: tuple[Any, ...]) -> tuple[list[Any], list[Any]]:
    if source.dataset is not None:
        rows = _dataset_rows(source.dataset, source.split)
        where = f"dataset {source.dataset!r}"
    else:
        assert source.path is not None
        rows = []
        for f in _files(source.path):
            rows += _jsonl_rows(f) if f.suffix == ".jsonl" else _parquet_rows(f)
        where = source.path
    train: list[Any] = []
    held: list[Any] = []
    for n, row in enumerate(rows, 1):
        if source.key is not None and source.key not in row:
            raise AgentSpecError(f"prompts: row {n} of {where} has no key column {source.key!r}")
        key = _canonical(row[source.key] if source.key is not None else row)
        (held if held_out(key, source.held_out_per_mille) else train).append(row)
    if not train:
        raise AgentSpecError(f"prompts: {where} has no training rows ({len(rows)} rows in all)")
    return train, held


def _stamp(source: PromptSource) -> tuple[Any, ...]:
    """What makes a cached read stale: the files' names, sizes and modification times."""
    if source.path is None:
        return ()
    try:
        files = _files(source.path)
    except AgentSpecError:
        return ("missing",)
    return tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)


def prompt_rows(source: PromptSource) -> tuple[list[Any], list[Any]]:
    """The training and held-out rows of a source (read once per process while unchanged)."""
    return _load(source, _stamp(source))


# -- the plugin -------------------------------------------------------------------------------


# How long one run of an agent function may take (its calls included) before it is cancelled
# as its input's fault: generous, for agents whose tools or model calls take minutes.
DEFAULT_EPISODE_TIMEOUT_S = 1800.0


class AgentSpec(TaskSpec):
    agent: str = Field(
        description="the agent function: 'package.module:function' or 'path/to/file.py:function'"
    )
    prompts: PromptSource = Field(description="where the prompts come from")
    max_turns: int = Field(
        default=8, ge=1, le=256, description="trained ctx.chat calls per trajectory"
    )
    tool_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="default timeout of ctx.tool and ctx.step calls (with the heartbeat "
        "timeout, below control_plane.progress_timeout_s: a node whose loops all wait on tools "
        "makes no progress)",
    )

    episode_timeout_s: float = Field(
        default=DEFAULT_EPISODE_TIMEOUT_S,
        gt=0,
        le=7 * 24 * 3600,
        description="seconds one run of the agent function may take; past it the run is "
        "cancelled and fails as its input's fault (retried, quarantined after the attempts)",
    )

    @field_validator("agent")
    @classmethod
    def _agent(cls, v: str) -> str:
        ref = resolve_ref(v)
        try:
            load_agent(ref)
        except AgentSpecError as e:
            raise ValueError(str(e)) from None
        return ref

    @model_validator(mode="after")
    def _prompts(self) -> AgentSpec:
        try:
            prompt_rows(self.prompts)
        except AgentSpecError as e:
            raise ValueError(str(e)) from None
        return self


# Specs validated in this process, by class and JSON (least recently used forgotten first).
_VALIDATED: OrderedDict[tuple[type[TaskSpec], str], TaskSpec] = OrderedDict()
_VALIDATED_MAX = 64
_VALIDATED_LOCK = threading.Lock()


def validated_once(spec_cls: type[TaskSpec], data: dict[str, Any]) -> TaskSpec:
    """``spec_cls.model_validate(data)``, once per process for each spec: validating an agent
    task's spec reads the file system (it imports and checks the agent function, stats and
    globs the prompt files), and a rollout node validates the spec of every episode it claims.
    Specs are frozen, so one instance is shared; a spec that fails is not kept (validated again
    next time, with the error raised each time). For specs as stored (their paths resolved when
    the task was registered), not as a user wrote them."""
    key = (spec_cls, json.dumps(data, sort_keys=True, default=str))
    with _VALIDATED_LOCK:
        spec = _VALIDATED.get(key)
        if spec is not None:
            _VALIDATED.move_to_end(key)
            return spec
    spec = spec_cls.model_validate(data)
    with _VALIDATED_LOCK:
        _VALIDATED[key] = spec
        while len(_VALIDATED) > _VALIDATED_MAX:
            _VALIDATED.popitem(last=False)
    return spec


class AgentTask:
    """The task of every agent: its prompts from the spec's file or dataset; the episode runtime
    (``rollcall.workers.episode``) plays them with the spec's agent function, whose tools and
    reward are its own."""

    name: ClassVar[str] = "agent"
    description: ClassVar[str] = "Your own async agent function over a prompt file."
    Spec: ClassVar[type[TaskSpec]] = AgentSpec

    def prompt(self, spec: TaskSpec, index: int) -> dict[str, Any]:
        assert isinstance(spec, AgentSpec)
        train, _ = prompt_rows(spec.prompts)
        return dict(train[index % len(train)])

    def eval_prompt(self, spec: TaskSpec, index: int) -> dict[str, Any]:
        assert isinstance(spec, AgentSpec)
        _, held = prompt_rows(spec.prompts)
        if not held:
            raise AgentSpecError(
                f"prompts: {spec.prompts.path or spec.prompts.dataset} has no held-out rows for "
                "evaluation; raise prompts.held_out_per_mille or set run.eval.episodes to 0"
            )
        return dict(held[index % len(held)])

    def instructions(self, spec: TaskSpec, prompt: dict[str, Any]) -> str:
        return json.dumps(prompt, sort_keys=True)
