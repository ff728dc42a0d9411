from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config import RollcallConfig, apply_overrides, load_config
from orchestrator.errors import UserError
from orchestrator.settings import mask_url, resolve_database
from tasks import registry

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


def test_engine_is_chosen_by_kind_and_vllm_fails_clearly_without_vllm(tmp_path: Path) -> None:
    from pydantic import TypeAdapter, ValidationError

    from orchestrator.config import EngineConfig, HFEngineConfig, VLLMEngineConfig
    from workers.rollout.engines.factory import make_engine
    from workers.rollout.engines.vllm import EngineUnavailable

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
    from orchestrator.config import VLLMEngineConfig

    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  engine: {kind: vllm, tensor_parallel_size: 2}\n")
    with pytest.raises(UserError, match=r"rollout.gpus_per_node \(0\) must be at least .* \(2\)"):
        load_config(p)
    with pytest.raises(UserError, match=r"max_model_len \(1024\) must be at least .* \(2048\)"):
        load_config(p, ["rollout.gpus_per_node=2", "rollout.engine.max_model_len=1024"])
    ok = ["rollout.gpus_per_node=2", "rollout.engine.max_model_len=1024", "rollout.max_tokens=1024"]
    engine = load_config(p, ok).rollout.engine
    assert isinstance(engine, VLLMEngineConfig) and engine.max_model_len == 1024


def test_a_cpu_vllm_engine_needs_no_gpus_and_refuses_what_vllm_cpu_cannot_do(
    tmp_path: Path,
) -> None:
    from orchestrator.config import VLLMEngineConfig

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
    from orchestrator.config import VLLMEngineConfig

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
