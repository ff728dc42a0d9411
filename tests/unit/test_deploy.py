"""The deployment examples in ``ops/deploy/`` against ``configs/production.yaml``: the Ray
cluster config passes Ray's own schema; both deployments advertise the custom resources and
GPUs the config's rollout nodes and trainer ranks ask for, with room for all of them, keep
rollout nodes off the trainer's machines, mount the shared storage the config's paths live on,
and give the migration and the runtime role their own secrets."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.config import RollcallConfig, VLLMEngineConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "ops" / "deploy"
PRODUCTION = ROOT / "configs" / "production.yaml"


@pytest.fixture(scope="module")
def prod() -> RollcallConfig:
    return load_config(PRODUCTION)


def _fits(cfg: RollcallConfig, pools: list[tuple[int, dict[str, float]]]) -> None:
    """``pools``: (machines, resources per machine). Every rollout node and trainer rank can be
    placed, rollout nodes only where ``rollout.resources`` is advertised, trainer ranks only
    where ``trainer.resources`` is, and never both kinds on one machine type."""
    r, t = cfg.rollout, cfg.trainer
    rollout_need = {**r.resources, "GPU": r.gpus_per_node, "CPU": r.cpus_per_node}
    trainer_need = {**t.resources, "GPU": 1.0, "CPU": t.cpus_per_rank}
    for nodes, need, role in (
        (r.nodes, rollout_need, "rollout"),
        (t.ranks, trainer_need, "trainer"),
    ):
        capacity = 0
        for machines, res in pools:
            if all(res.get(k, 0) >= v for k, v in need.items()):
                capacity += machines * int(min(res[k] // v for k, v in need.items() if v > 0))
        assert capacity >= nodes, f"room for {capacity} {role} actors, the config has {nodes}"
    for _, res in pools:
        assert not (set(r.resources) <= set(res) and set(t.resources) <= set(res)), res


def test_production_config_is_the_gpu_deployment(prod: RollcallConfig) -> None:
    assert isinstance(prod.rollout.engine, VLLMEngineConfig)
    assert prod.rollout.gpus_per_node >= prod.rollout.engine.tensor_parallel_size
    assert prod.trainer.device == "cuda"
    assert prod.rollout.resources and prod.trainer.resources
    assert prod.database.url is None  # the password comes from the environment
    assert prod.metrics.enabled and prod.metrics.host == "127.0.0.1"
    assert prod.ray.address == "auto"
    # the paths every machine reads are on the shared mount
    assert prod.model.path is not None and prod.model.path.startswith("/shared/")
    assert prod.run.dir is not None and prod.run.dir.startswith("/shared/")
    assert prod.rollout.engine.max_model_len is not None
    assert prod.rollout.engine.max_model_len >= prod.rollout.max_tokens


def test_ray_cluster_config_passes_ray_s_schema_and_fits_the_job(prod: RollcallConfig) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    validate_config(prepare_config(copy.deepcopy(raw)))
    bad = copy.deepcopy(raw)
    bad["available_node_types"]["rollout"]["min_worker"] = 1  # a typo is caught
    with pytest.raises(Exception, match="min_worker"):
        validate_config(prepare_config(bad))
    types = raw["available_node_types"]
    head = types[raw["head_node_type"]]
    pools = [(1, head["resources"])] + [
        (t["max_workers"], t["resources"])
        for name, t in types.items()
        if name != raw["head_node_type"]
    ]
    _fits(prod, pools)
    for name, t in types.items():
        if name != raw["head_node_type"]:
            assert t["min_workers"] == t["max_workers"], "rollout capacity must not scale away"
    assert any("/shared" in c for c in raw["setup_commands"])
    assert any("--dashboard-host=127.0.0.1" in c for c in raw["head_start_ray_commands"]), (
        "the Ray dashboard must not face the network"
    )


def _ray_resources(start_params: dict[str, str]) -> dict[str, float]:
    """Custom resources and GPUs a KubeRay group advertises (``rayStartParams``)."""
    out: dict[str, float] = {}
    if "resources" in start_params:
        text = start_params["resources"]
        assert text.startswith('"') and text.endswith('"'), "KubeRay wants the quoted form"
        out.update(json.loads(text[1:-1].replace('\\"', '"')))
    if "num-gpus" in start_params:
        out["GPU"] = float(start_params["num-gpus"])
    return out


def _container(group: dict[str, Any]) -> dict[str, Any]:
    (c,) = group["template"]["spec"]["containers"]
    return c


def _secret_of(container: dict[str, Any]) -> str | None:
    for e in container.get("env", []):
        if e["name"] == "ROLLCALL_DATABASE_URL":
            return str(e["valueFrom"]["secretKeyRef"]["name"])
    return None


def test_kuberay_manifests_fit_the_job(prod: RollcallConfig) -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "kuberay-rayjob.yaml").read_text()))
    by_kind = {d["kind"]: d for d in docs if d["kind"] != "Secret"}
    secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    assert {"RayJob", "Job", "PersistentVolumeClaim"} <= set(by_kind)
    job = by_kind["RayJob"]
    assert job["apiVersion"] == "ray.io/v1"
    assert job["spec"]["entrypoint"].startswith("rollcall run ")
    assert "configs/production.yaml" in job["spec"]["entrypoint"]
    cluster = job["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]
    workers = cluster["workerGroupSpecs"]

    # what each group advertises to Ray: its custom resources and GPUs, and the pod's CPUs
    # (KubeRay sets num-cpus from the container's limit)
    def advertised(group: dict[str, Any]) -> dict[str, float]:
        cpus = float(_container(group)["resources"]["limits"]["cpu"])
        return {**_ray_resources(group["rayStartParams"]), "CPU": cpus}

    pools = [(1, advertised(head))]
    for g in workers:
        assert g["minReplicas"] == g["replicas"] == g["maxReplicas"]
        pools.append((g["replicas"], advertised(g)))
    _fits(prod, pools)
    # the GPUs Ray is told about are the GPUs the pods get
    for group in [head, *workers]:
        limits = _container(group)["resources"]["limits"]
        assert float(limits["nvidia.com/gpu"]) == float(group["rayStartParams"]["num-gpus"])
    # shared storage on every pod, where the config's paths are
    claim = by_kind["PersistentVolumeClaim"]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    for group in [head, *workers]:
        mounts = {m["name"]: m["mountPath"] for m in _container(group)["volumeMounts"]}
        vols = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        assert mounts["shared"] == "/shared"
        assert vols["shared"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    # the migration runs `rollcall db upgrade` as the migrator; the job runs as the runtime role
    migrate = by_kind["Job"]["spec"]["template"]["spec"]["containers"][0]
    assert migrate["command"] == ["rollcall", "db", "upgrade"]
    assert _secret_of(migrate) == "rollcall-db-migrator"
    assert _secret_of(_container(head)) == "rollcall-db-runtime"
    assert all(_secret_of(_container(g)) is None for g in workers)
    assert {"rollcall-db-migrator", "rollcall-db-runtime"} <= secrets
    # metrics: the pod's port is declared and matches the config's
    ports = {p["name"]: p["containerPort"] for p in _container(head)["ports"]}
    assert ports["metrics"] == prod.metrics.port
    assert "metrics.host=" in job["spec"]["entrypoint"]


def test_the_fit_check_can_fail(prod: RollcallConfig) -> None:
    too_few = prod.model_copy(update={"rollout": prod.rollout.model_copy(update={"nodes": 17})})
    with pytest.raises(AssertionError, match="room for 16 rollout"):
        _fits(
            too_few,
            [(1, {"CPU": 96, "GPU": 8, "trainer": 8}), (4, {"CPU": 48, "GPU": 4, "rollout": 4})],
        )
    with pytest.raises(AssertionError, match="room for 0 trainer"):
        _fits(prod, [(1, {"CPU": 96, "GPU": 8}), (4, {"CPU": 48, "GPU": 4, "rollout": 4})])
