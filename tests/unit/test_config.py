from __future__ import annotations

import copy
import dataclasses
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rollcall.orchestrator import settings
from rollcall.orchestrator.config import RollcallConfig, apply_overrides, load_config
from rollcall.orchestrator.errors import UserError
from rollcall.orchestrator.settings import mask_url, resolve_database, rollcall_home
from rollcall.tasks import registry

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_file_loads_and_names_known_plugins(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, RollcallConfig)
    for task in cfg.tasks:
        plugin = registry.get(task.plugin)
        plugin.Spec.model_validate(task.spec)


def test_configs_folder_is_not_empty() -> None:
    assert (CONFIGS / "quickstart.yaml").exists()


def test_unknown_key_is_named(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("job:\n  name: a\n  nmae: b\n")
    with pytest.raises(UserError, match=r"job\.nmae: unknown key"):
        load_config(p)


def test_bad_quota_in_config_is_named(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("tasks:\n  - name: a\n    plugin: echo\n    weight: 0\n")
    with pytest.raises(UserError, match=r"tasks\.0\.weight"):
        load_config(p)


def test_duplicate_task_names_rejected(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("tasks:\n  - {name: a, plugin: echo}\n  - {name: a, plugin: echo}\n")
    with pytest.raises(UserError, match="repeated: a"):
        load_config(p)


def test_malformed_yaml_names_line(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("job:\n  name: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML at line"):
        load_config(p)


def test_overrides_are_yaml_scalars_not_code() -> None:
    data = apply_overrides({"job": {"name": "a"}}, ["job.name=b", "x.y=3", "z=__import__('os')"])
    assert data == {"job": {"name": "b"}, "x": {"y": 3}, "z": "__import__('os')"}


def test_override_without_equals_rejected() -> None:
    with pytest.raises(UserError, match=r"dotted\.key=value"):
        apply_overrides({}, ["job.name"])


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("postgresql://u:s3cret@h:5432/db", "postgresql://u:***@h:5432/db"),
        (
            "postgresql+psycopg://user:p%40ss@host/db?sslmode=require",
            "postgresql+psycopg://user:***@host/db?sslmode=require",
        ),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("postgresql://h/db", "postgresql://h/db"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_database_resolution_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ROLLCALL_DATABASE_URL", raising=False)
    monkeypatch.setenv("ROLLCALL_HOME", str(tmp_path))
    assert resolve_database().embedded
    assert resolve_database().home == tmp_path
    assert resolve_database(config_url="postgresql://c/db").url == "postgresql://c/db"
    monkeypatch.setenv("ROLLCALL_DATABASE_URL", "postgresql://env/db")
    assert resolve_database(config_url="postgresql://c/db").url == "postgresql://env/db"
    assert resolve_database("postgresql://x/db", "postgresql://c/db").url == "postgresql://x/db"


@pytest.mark.parametrize("euid", [0, 1000])
def test_default_home_is_var_lib_for_root_unless_an_old_database_is_in_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, euid: int
) -> None:
    """Root's embedded PostgreSQL runs as another user, which must not need a way into a
    private /root: root's default home is /var/lib/rollcall, except where an earlier rollcall
    left its database in ~/.rollcall. A normal user's is ~/.rollcall."""
    monkeypatch.delenv("ROLLCALL_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(settings.os, "geteuid", lambda: euid)
    mine = tmp_path / ".rollcall"
    assert rollcall_home() == (settings.ROOT_HOME if euid == 0 else mine)
    (mine / "postgres" / "data").mkdir(parents=True)
    assert rollcall_home() == mine
    assert rollcall_home("/elsewhere") == Path("/elsewhere")


def test_engine_is_chosen_by_kind_and_vllm_fails_clearly_without_vllm(tmp_path: Path) -> None:
    from pydantic import TypeAdapter, ValidationError

    from rollcall.orchestrator.config import EngineConfig, HFEngineConfig, VLLMEngineConfig
    from rollcall.workers.rollout.engines.factory import make_engine
    from rollcall.workers.rollout.engines.vllm import EngineUnavailable

    adapter: TypeAdapter[EngineConfig] = TypeAdapter(EngineConfig)
    assert isinstance(adapter.validate_python({"kind": "hf"}), HFEngineConfig)
    v = adapter.validate_python({"kind": "vllm", "gpu_memory_utilization": 0.5})
    assert isinstance(v, VLLMEngineConfig) and v.enable_prefix_caching
    with pytest.raises(ValidationError):
        adapter.validate_python({"kind": "tgi"})
    with pytest.raises(ValidationError):
        adapter.validate_python({"kind": "vllm", "gpu_memory_utilization": 1.5})
    import importlib.util

    if importlib.util.find_spec("vllm") is None:  # CPU machines: the extra cannot be installed
        with pytest.raises(EngineUnavailable, match=r"pip install 'rollcall\[vllm\]'"):
            make_engine(v, tmp_path)


def test_a_vllm_engine_needs_its_gpus_and_a_context_for_whole_trajectories(
    tmp_path: Path,
) -> None:
    from rollcall.orchestrator.config import VLLMEngineConfig

    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  engine: {kind: vllm, tensor_parallel_size: 2}\n")
    with pytest.raises(UserError, match=r"rollout.gpus_per_node \(0\) must be at least .* \(2\)"):
        load_config(p)
    with pytest.raises(UserError, match=r"max_model_len \(1024\) must be at least .* \(2048\)"):
        load_config(p, ["rollout.gpus_per_node=2", "rollout.engine.max_model_len=1024"])
    ok = ["rollout.gpus_per_node=2", "rollout.engine.max_model_len=1024", "rollout.max_tokens=1024"]
    engine = load_config(p, ok).rollout.engine
    assert isinstance(engine, VLLMEngineConfig) and engine.max_model_len == 1024


def test_a_mixed_fleet_names_the_engines_of_its_first_nodes(tmp_path: Path) -> None:
    """``rollout.node_engines``: node i runs node_engines[i], the others rollout.engine; each
    vLLM engine is checked as rollout.engine is, under its own key."""
    from rollcall.orchestrator.config import HFEngineConfig, VLLMEngineConfig
    from rollcall.orchestrator.runner.nodes import node_config

    p = tmp_path / "c.yaml"
    p.write_text(
        "rollout:\n  nodes: 3\n  max_tokens: 1024\n"
        "  node_engines: [{kind: vllm, device: cpu, max_model_len: 1024}]\n"
    )
    cfg = load_config(p)
    engines = [node_config(cfg, i, model_dir=tmp_path, chat_template=None).engine
               for i in range(3)]  # fmt: skip
    assert isinstance(engines[0], VLLMEngineConfig)
    assert all(isinstance(e, HFEngineConfig) for e in engines[1:])
    with pytest.raises(UserError, match=r"rollout.node_engines\[0\].max_model_len \(1024\)"):
        load_config(p, ["rollout.max_tokens=2048"])
    p.write_text(p.read_text().replace("nodes: 3", "nodes: 1").replace("}]", "}, {kind: hf}]"))
    with pytest.raises(UserError, match=r"names 2 engines for 1 rollout nodes"):
        load_config(p)


def test_a_cpu_vllm_engine_needs_no_gpus_and_refuses_what_vllm_cpu_cannot_do(
    tmp_path: Path,
) -> None:
    from rollcall.orchestrator.config import VLLMEngineConfig

    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  engine: {kind: vllm, device: cpu, dtype: float32}\n")
    engine = load_config(p).rollout.engine  # no gpus_per_node needed
    assert isinstance(engine, VLLMEngineConfig) and engine.device == "cpu"
    assert engine.cpu_kv_cache_gib == 1 and engine.cpu_threads_bind == "nobind"
    assert load_config(p, ["rollout.engine.cpu_threads_bind=0-1,3"]).rollout.engine
    with pytest.raises(UserError, match=r"float16 is not supported by vLLM on CPU"):
        load_config(p, ["rollout.engine.dtype=float16"])
    with pytest.raises(UserError, match=r"tensor_parallel_size must be 1 with device cpu"):
        load_config(p, ["rollout.engine.tensor_parallel_size=2"])
    with pytest.raises(UserError, match=r"cpu_threads_bind"):
        load_config(p, ["rollout.engine.cpu_threads_bind=everywhere"])
    with pytest.raises(UserError, match=r"cpu_kv_cache_gib"):
        load_config(p, ["rollout.engine.cpu_kv_cache_gib=0"])
    with pytest.raises(UserError, match=r"request_timeout_s"):
        load_config(p, ["rollout.engine.request_timeout_s=0"])


def test_the_vllm_quickstart_config_is_the_quickstart_with_a_cpu_vllm_node() -> None:
    from rollcall.orchestrator.config import VLLMEngineConfig

    root = Path(__file__).resolve().parents[2] / "configs"
    hf, vl = load_config(root / "quickstart.yaml"), load_config(root / "quickstart-vllm.yaml")
    assert isinstance(vl.rollout.engine, VLLMEngineConfig) and vl.rollout.engine.device == "cpu"
    same = ["buffer", "trainer", "run", "tasks", "model", "ray"]
    assert {k: getattr(vl, k) for k in same} == {k: getattr(hf, k) for k in same}
    strip = {"engine", "start_timeout_s"}
    assert vl.rollout.model_dump(exclude=strip) == hf.rollout.model_dump(exclude=strip)


def test_loss_temperature_must_match_the_sampling_temperature(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  temperature: 0.7\n")
    with pytest.raises(UserError, match=r"trainer.loss.temperature \(1\) must equal"):
        load_config(p)
    assert load_config(p, ["trainer.loss.temperature=0.7"]).rollout.temperature == 0.7


def test_algorithm_choices_are_named_in_config(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("trainer:\n  loss:\n    correction: {kind: decoupled, cap: 3}\n")
    assert load_config(p).trainer.loss.correction.kind == "decoupled"
    with pytest.raises(UserError, match=r"trainer\.loss\.correction"):
        load_config(p, ["trainer.loss.correction.kind=vtrace"])


# -- bounds: every numeric value of every config model (issue 18, item 14) --------------------


def _constraints(metadata: Any) -> dict[str, Any]:
    """ge/gt/le/lt of a field's (or a type argument's) metadata, FieldInfo objects flattened."""
    from pydantic.fields import FieldInfo

    out: dict[str, Any] = {}
    for m in metadata:
        if isinstance(m, FieldInfo):
            out.update(_constraints(m.metadata))
        for key in ("ge", "gt", "le", "lt"):
            if getattr(m, key, None) is not None:
                out[key] = getattr(m, key)
    return out


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One numeric value of a config: where it is (``loc``, as pydantic reports it, without
    union tags), how to put a value there (``data``), its type and its constraints."""

    loc: tuple[str | int, ...]
    kind: type
    bounds: dict[str, Any]
    put: Callable[[Any], dict[str, Any]]

    @property
    def id(self) -> str:
        return ".".join(str(p) for p in self.loc)


def _nest(path: tuple[Any, ...], value: Any, setup: dict[str, Any]) -> dict[str, Any]:
    """``setup`` (the data that selects union members, gives required fields) with ``value``
    at ``path``; a path element that is an int indexes a list in ``setup``."""
    data = copy.deepcopy(setup)
    node: Any = data
    for p in path[:-1]:
        node = node[p] if isinstance(p, int) else node.setdefault(p, {})
    node[path[-1]] = value
    return data


def _leaves(model: Any, path: tuple[Any, ...], setup: dict[str, Any]) -> Iterator[Leaf]:
    for name, field in model.model_fields.items():
        yield from _walk(field.annotation, field.metadata, (*path, name), setup)


def _walk(ann: Any, metadata: Any, path: tuple[Any, ...], setup: dict[str, Any]) -> Iterator[Leaf]:
    from pydantic import BaseModel

    origin = typing.get_origin(ann)
    if origin is typing.Annotated:
        inner, *meta = typing.get_args(ann)
        yield from _walk(inner, [*metadata, *meta], path, setup)
    elif origin in (typing.Union, types.UnionType):
        for member in typing.get_args(ann):
            if member is type(None):
                continue
            if isinstance(member, type) and issubclass(member, BaseModel):
                kind = member.model_fields.get("kind")
                sub = {"kind": kind.default} if kind is not None else {}
                yield from _leaves(member, path, _nest(path, sub, setup))
            else:
                yield from _walk(member, metadata, path, setup)
    elif isinstance(ann, type) and issubclass(ann, BaseModel):
        yield from _leaves(ann, path, setup)
    elif origin is list:  # tasks: one task with its required fields (run.trackers: names)
        (item,) = typing.get_args(ann)
        if not (isinstance(item, type) and issubclass(item, BaseModel)):
            return
        base = _nest(path, [{"name": "t", "plugin": "echo"}], setup)
        yield from _leaves(item, (*path, 0), base)
    elif origin is tuple:  # trainer.betas: one element at a time, the other valid
        args = typing.get_args(ann)

        def put_item(i: int) -> Callable[[Any], dict[str, Any]]:
            return lambda v: _nest(path, [v if j == i else 0.5 for j in range(len(args))], setup)

        for i, arg in enumerate(args):
            for leaf in _walk(arg, [], (*path, i), setup):
                yield dataclasses.replace(leaf, put=put_item(i))
    elif origin is dict:  # custom Ray resources
        _, value = typing.get_args(ann)
        for leaf in _walk(value, [], (*path, "x"), setup):
            yield dataclasses.replace(leaf, put=lambda v: _nest(path, {"x": v}, setup))
    elif ann in (int, float):
        bounds = _constraints(metadata)
        yield Leaf(path, ann, bounds, lambda v: _nest(path, v, setup))


LEAVES = list(_leaves(RollcallConfig, (), {}))


def test_the_walk_finds_the_numeric_values_of_every_section() -> None:
    ids = {leaf.id for leaf in LEAVES}
    for expected in (
        "tasks.0.weight", "tasks.0.max_inflight", "buffer.batch_groups", "run.seed",
        "trainer.betas.0", "trainer.resources.x", "rollout.engine.max_model_len",
        "trainer.timing_model.publish_bytes", "trainer.loss.correction.cap",
        "trainer.loss.aggregation.max_tokens", "control_plane.heartbeat_timeout_s",
    ):  # fmt: skip
        assert expected in ids
    assert len(LEAVES) >= 85


def _hi(b: dict[str, Any]) -> Any:
    return b["le"] if "le" in b else b["lt"]


def _lo(b: dict[str, Any]) -> Any:
    return b["ge"] if "ge" in b else b["gt"]


def _out_of_range(leaf: Leaf) -> list[Any]:
    """Values just outside the leaf's bounds, and the non-finite floats."""
    b = leaf.bounds
    values: list[Any] = []
    if "le" in b or "lt" in b:
        hi, closed = _hi(b), "le" in b
        if leaf.kind is int:
            values.append(hi + 1 if closed else hi)
        else:
            values.append((hi * 2 or 1.0) if closed else hi)
    if "ge" in b or "gt" in b:
        lo, closed = _lo(b), "ge" in b
        if leaf.kind is int:
            values.append(lo - 1 if closed else lo)
        else:
            values.append((lo / 2 if lo > 0 else lo - 1) if closed else lo)
    if leaf.kind is float:
        values += [float("nan"), float("inf"), float("-inf")]
    return values


@pytest.mark.parametrize("leaf", LEAVES, ids=lambda leaf: leaf.id)
def test_every_numeric_config_value_is_bounded_on_both_sides(leaf: Leaf) -> None:
    b = leaf.bounds
    assert ("ge" in b or "gt" in b) and ("le" in b or "lt" in b), f"{leaf.id}: bounds {b}"
    if leaf.kind is int:  # what an integer column (int32) holds, at most
        assert _hi(b) <= 2**31 - 1 and _lo(b) >= -(2**31)


@pytest.mark.parametrize("leaf", LEAVES, ids=lambda leaf: leaf.id)
def test_values_out_of_bounds_are_refused_naming_the_value(leaf: Leaf) -> None:
    from pydantic import ValidationError

    for value in _out_of_range(leaf):
        with pytest.raises(ValidationError) as info:
            RollcallConfig.model_validate(leaf.put(value))
        locs = [tuple(p for p in e["loc"] if p in leaf.loc) for e in info.value.errors()]
        assert leaf.loc in locs, (value, info.value.errors())


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("buffer.batch_groups=99999999999", r"buffer\.batch_groups: Input should be less than"),
        ("tasks.0.max_inflight=99999999999", r"tasks\.0\.max_inflight: Input should be less"),
        ("tasks.0.max_staleness=99999999999", r"tasks\.0\.max_staleness: Input should be less"),
        ("tasks.0.weight=1e308", r"tasks\.0\.weight: Input should be less than or equal to"),
        ("tasks.0.weight=1e-320", r"tasks\.0\.weight: Input should be greater than or equal"),
        ("tasks.0.weight=.nan", r"tasks\.0\.weight: Input should be a finite number"),
        ("trainer.lr=.inf", r"trainer\.lr: Input should be a finite number"),
        ("trainer.betas=[0.9, 1.0]", r"trainer\.betas\.1: Input should be less than 1"),
        ("control_plane.lease_sweep_interval_s=1e308", r"lease_sweep_interval_s: Input should"),
        ("run.seed=-1", r"run\.seed: Input should be greater than or equal to 0"),
    ],
)
def test_named_bad_values_are_refused(tmp_path: Path, override: str, message: str) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("tasks:\n  - {name: a, plugin: echo}\n")
    data = yaml.safe_load(p.read_text())
    key, _, raw = override.partition("=")
    if key.startswith("tasks.0."):  # overrides address mappings; a task is a list item
        data["tasks"][0][key.removeprefix("tasks.0.")] = yaml.safe_load(raw)
        p.write_text(yaml.safe_dump(data))
        overrides = []
    else:
        overrides = [override]
    with pytest.raises(UserError, match=message):
        load_config(p, overrides)


def test_values_at_the_bounds_are_accepted(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(
        "tasks:\n"
        "  - {name: a, plugin: echo, weight: 1.0e-6, max_inflight: 100000, max_staleness: 2}\n"
        "  - {name: b, plugin: echo, weight: 1.0e+6, max_inflight: 1, max_staleness: 0}\n"
    )
    cfg = load_config(p, ["trainer.betas=[0.0, 0.999]", "run.seed=1000000"])
    assert [t.weight for t in cfg.tasks] == [1e-6, 1e6]


# -- configs that cannot make progress are refused (issue 18, item 10) ------------------------

TWO_TASKS = (
    "tasks:\n"
    "  - {name: fresh, plugin: echo, weight: FRESH, max_staleness: 0}\n"
    "  - {name: patient, plugin: echo, weight: 1, max_staleness: 3}\n"
)


@pytest.mark.parametrize(
    ("tasks", "overrides", "message"),
    [
        # weights published every 4 steps: the last step before a publication trains only data
        # at most 3 versions old; no task allows that
        (
            "tasks:\n  - {name: a, plugin: echo, max_staleness: 2}\n",
            ["trainer.sync_every=4"],
            r"buffer\.batch_groups \(8\) cannot be filled: .*trainer\.sync_every \(4\).* "
            r"max_staleness of at least 3",
        ),
        # one task allows it, but its admission cap (4 x its share 1 of 8) holds 4 groups
        (
            TWO_TASKS.replace("FRESH", "7"),
            ["trainer.sync_every=4"],
            r"buffer\.batch_groups \(8\) cannot be filled: .*at most 4 groups",
        ),
        # sync mode trains on-policy data only: weights after every step
        (
            "tasks:\n  - {name: a, plugin: echo, max_staleness: 8}\n",
            ["run.mode=sync", "trainer.sync_every=2"],
            r"trainer\.sync_every must be 1 with run\.mode sync",
        ),
        (
            "tasks:\n  - {name: a, plugin: echo}\n",
            ["buffer.batch_groups=60000"],
            r"admission caps add up to 180000 groups",
        ),
        (
            "tasks:\n  - {name: a, plugin: echo}\n",
            ["control_plane.dead_sweep_interval_s=3"],
            r"control_plane\.dead_sweep_interval_s \(3\) must be at most a quarter of "
            r"control_plane\.heartbeat_timeout_s \(10\)",
        ),
        (
            "tasks:\n  - {name: a, plugin: echo}\n",
            ["control_plane.lease_sweep_interval_s=40"],
            r"control_plane\.lease_sweep_interval_s \(40\) must be at most half of "
            r"buffer\.lease_s \(60\)",
        ),
        (
            "tasks:\n  - {name: a, plugin: echo}\n",
            ["buffer.lease_s=10", "buffer.retry_window_s=5", "control_plane.lease_sweep_interval_s=1"],
            r"buffer\.lease_s \(10\) must exceed control_plane\.heartbeat_timeout_s \(10\)",
        ),
        (
            "tasks:\n  - {name: a, plugin: echo, max_staleness: 4}\n",
            ["trainer.sync_every=2", "trainer.checkpoint_every=3"],
            r"trainer\.checkpoint_every \(3\) and trainer\.sync_every \(2\) must be multiples "
            r"of one another",
        ),
    ],
    ids=[
        "staleness-below-sync", "fresh-tasks-too-small", "sync-mode-sync-every",
        "admission-too-large", "dead-sweep", "lease-sweep", "lease-vs-heartbeat",
        "checkpoint-between-publications",
    ],
)  # fmt: skip
def test_configs_that_cannot_progress_are_refused(
    tmp_path: Path, tasks: str, overrides: list[str], message: str
) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(tasks)
    with pytest.raises(UserError, match=message):
        load_config(p, overrides)


@pytest.mark.parametrize(
    ("tasks", "overrides"),
    [
        ("tasks:\n  - {name: a, plugin: echo, max_staleness: 3}\n", ["trainer.sync_every=4"]),
        # the stale-intolerant task only gets its data trained early in each publication period;
        # the other one can fill every batch alone (cap 4 x 4 = 16 groups >= 8)
        (TWO_TASKS.replace("FRESH", "1"), ["trainer.sync_every=4"]),
        ("tasks:\n  - {name: a, plugin: echo}\n", ["run.mode=sync"]),
        (
            "tasks:\n  - {name: a, plugin: echo, max_staleness: 4}\n",
            ["trainer.sync_every=2", "trainer.checkpoint_every=4"],
        ),
        # checkpoints more often than publications, or publications more often (issue 18, 7)
        ("tasks:\n  - {name: a, plugin: echo, max_staleness: 4}\n", ["trainer.sync_every=4"]),
        ("tasks:\n  - {name: a, plugin: echo}\n", ["trainer.checkpoint_every=3"]),
        ("tasks:\n  - {name: a, plugin: echo}\n", ["control_plane.dead_sweep_interval_s=2.5"]),
        ("tasks:\n  - {name: a, plugin: echo}\n", ["buffer.batch_groups=30000"]),
    ],
)
def test_configs_that_can_progress_are_accepted(
    tmp_path: Path, tasks: str, overrides: list[str]
) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(tasks)
    assert load_config(p, overrides)


def test_the_smollm2_vllm_config_is_the_smollm2_config_with_a_cpu_vllm_node() -> None:
    from rollcall.orchestrator.config import VLLMEngineConfig

    root = Path(__file__).resolve().parents[2] / "configs"
    hf, vl = load_config(root / "smollm2.yaml"), load_config(root / "smollm2-vllm.yaml")
    assert hf.model.builtin == "smollm2-135m" and hf.model.tool_format == "hermes"
    assert isinstance(vl.rollout.engine, VLLMEngineConfig) and vl.rollout.engine.device == "cpu"
    same = ["buffer", "trainer", "run", "tasks", "model", "ray"]
    assert {k: getattr(vl, k) for k in same} == {k: getattr(hf, k) for k in same}
    strip = {"engine", "start_timeout_s"}
    assert vl.rollout.model_dump(exclude=strip) == hf.rollout.model_dump(exclude=strip)


def test_an_unreadable_chat_template_file_is_refused(tmp_path: Path) -> None:
    from rollcall.orchestrator.config import read_chat_template

    with pytest.raises(UserError, match=r"model.chat_template .* cannot be read"):
        read_chat_template(str(tmp_path / "missing.jinja"))
