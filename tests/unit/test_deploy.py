"""The deployment examples in ``ops/deploy/`` against ``configs/production.yaml``: the Ray
cluster config passes Ray's own schema; both deployments advertise the custom resources and
GPUs the config's rollout nodes and trainer ranks ask for, with room for all of them, keep
rollout nodes off the trainer's machines, mount the shared storage the config's paths live on,
and give the migration and the runtime role their own secrets. The manual for machines started
with ``ray start`` names real config keys and commands, and its ``ray start`` lines advertise
what its ``rollcall run`` asks for; the Slurm script parses, and run against stand-ins for
``srun``, ``scontrol``, ``ray`` and ``rollcall`` it starts the head and the rollout machines
with the resources the job needs, waits for them, runs the job and stops Ray."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml
from pydantic import BaseModel

from rollcall.orchestrator.config import RollcallConfig, VLLMEngineConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "ops" / "deploy"
PRODUCTION = ROOT / "configs" / "production.yaml"
MANUAL = DEPLOY / "ray-start.md"
SBATCH = DEPLOY / "slurm" / "rollcall.sbatch"


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


# --- ray-start.md: machines started by hand -------------------------------------------------

_SECTIONS = "|".join(RollcallConfig.model_fields)
# a config key in backticks, e.g. `rollout.capacity_wait_s` (not `ray.init()`)
_KEY = re.compile(rf"`((?:{_SECTIONS})(?:\.[a-z_]\w*)+)(?![\w(])")


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The config sections an annotation holds (through unions, ``Annotated``, ``None``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in _models(a)]


def _is_config_key(dotted: str) -> bool:
    models: list[type[BaseModel]] = [RollcallConfig]
    for part in dotted.split("."):
        if not models:  # inside a mapping, e.g. rollout.resources.rollout
            return True
        fields = [m.model_fields[part] for m in models if part in m.model_fields]
        if not fields:
            return False
        models = [m for f in fields for m in _models(f.annotation)]
    return True


def _bash_commands(text: str) -> list[list[str]]:
    """Each command of the ```bash blocks, as shell words: continuation lines joined,
    comments and leading ``VAR=value`` assignments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and re.match(r"[A-Za-z_]\w*=", words[0]):
                words.pop(0)
            if words:
                out.append(words)
    return out


def _leaf(group: Any, words: list[str]) -> tuple[Any, list[str]]:
    """The click command that ``words`` name in ``group``, and the words after its name."""
    cmd, rest = group, list(words)  # click's groups, or typer's (its own click)
    while rest and rest[0] in getattr(cmd, "commands", {}):
        cmd = cmd.commands[rest.pop(0)]
    assert not (hasattr(cmd, "commands") and rest), f"{' '.join(words)}: not a command"
    return cmd, rest


def _check_options(cmd: Any, words: list[str], what: str) -> None:
    opts = {o for p in cmd.params for o in [*p.opts, *getattr(p, "secondary_opts", [])]}
    for w in words:
        w = w.strip("[]")
        if w.startswith("--"):
            assert w.split("=", 1)[0] in opts, f"{what}: {w} is not an option of {cmd.name}"


def _ray_commands() -> dict[str, set[str]]:
    """``ray``'s commands and their options, read from Ray's CLI source (importing it takes
    seconds): the ``--option`` names in the decorators above each ``def``."""
    import importlib.util

    spec = importlib.util.find_spec("ray")
    assert spec is not None and spec.origin is not None
    lines = (Path(spec.origin).parent / "scripts" / "scripts.py").read_text().splitlines()
    out: dict[str, set[str]] = {}
    for i, line in enumerate(lines):
        m = re.match(r"def (\w+)\(", line)
        if not m:
            continue
        j = i - 1  # back to the command's first decorator, not past the previous def
        while j > 0 and not re.match(r"@(cli|click)\.command|def ", lines[j]):
            j -= 1
        if not re.match(r"@(cli|click)\.command", lines[j]):
            continue
        block = "\n".join(lines[j:i])
        named = re.search(r'command\(\s*(?:name=)?"([\w-]+)"', block)
        out[named[1] if named else m[1].replace("_", "-")] = set(re.findall(r'"(--[\w-]+)"', block))
    return out


def _check_ray(words: list[str], commands: dict[str, set[str]], what: str) -> None:
    assert words[0] in commands, f"{what}: ray has no command {words[0]}"
    for w in words[1:]:
        if w.startswith("--"):
            assert w.split("=", 1)[0] in commands[words[0]], f"{what}: ray {words[0]} has no {w}"


@pytest.fixture(scope="module")
def rollcall_cli() -> Any:
    from typer.main import get_command

    from rollcall.orchestrator.cli import app

    return get_command(app)


@pytest.mark.parametrize("path", [MANUAL, DEPLOY / "README.md"], ids=lambda p: p.name)
def test_deploy_docs_name_real_config_keys_and_links(path: Path) -> None:
    text = path.read_text()
    keys = set(_KEY.findall(text))
    assert keys, "no config key found: the pattern is wrong"
    assert not {k for k in keys if not _is_config_key(k)}, f"{path.name}: not config keys"
    # relative links resolve, and so do their anchors (GitHub's heading slugs)
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", link):
            continue
        file, _, anchor = link.partition("#")
        target = (path.parent / file).resolve() if file else path
        assert target.exists(), f"{path.name}: link {link} does not resolve"
        if anchor and target.suffix == ".md":
            slugs = {
                re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                for h in re.findall(r"(?m)^#+ (.*)$", target.read_text())
            }
            assert anchor in slugs, f"{path.name}: no heading for #{anchor} in {file}"


def test_the_doc_checks_can_fail(rollcall_cli: Any) -> None:
    assert _is_config_key("trainer.weights.transport")
    assert _is_config_key("rollout.resources.rollout")
    assert _is_config_key("rollout.engine.tensor_parallel_size")
    assert not _is_config_key("rollout.capacity_wait")
    assert not _is_config_key("ray.head")
    assert _KEY.findall("`ray.init()` and `ray.address=HEAD:6379`") == ["ray.address"]
    with pytest.raises(AssertionError, match="not a command"):
        _leaf(rollcall_cli, ["node", "remove", "abc"])
    cmd, rest = _leaf(rollcall_cli, ["node", "drain", "abc", "--deadline"])
    with pytest.raises(AssertionError, match="--deadline is not an option of drain"):
        _check_options(cmd, rest, "drain")
    with pytest.raises(AssertionError, match="ray start has no --gcs-port"):
        _check_ray(["start", "--gcs-port=6379"], _ray_commands(), "x")


def test_manual_commands_are_real_and_fit_the_job(rollcall_cli: Any) -> None:
    ray_commands = _ray_commands()
    assert {"--head", "--resources", "--min-worker-port"} <= ray_commands["start"]
    assert "--generate" in ray_commands["get-auth-token"]
    text = MANUAL.read_text()
    commands = _bash_commands(text)
    # inline ones too: `rollcall status --job production --watch`, ...
    commands += [shlex.split(c) for c in re.findall(r"`(rollcall [^`]+)`", text)]
    starts: dict[str, dict[str, str]] = {}
    runs = []
    for words in commands:
        if words[0] == "rollcall":
            cmd, rest = _leaf(rollcall_cli, words[1:])
            _check_options(cmd, rest, " ".join(words))
            if cmd.name == "run" and rest and rest[0].endswith(".yaml"):
                runs.append(rest)
        elif words[0] == "ray":
            _check_ray(words[1:], ray_commands, " ".join(words))
            if words[1] == "start":
                flags = dict(w.split("=", 1) for w in words if "=" in w)
                starts["head" if "--head" in words else "rollout"] = flags
        elif words[0].startswith("--"):  # the pinned ports: options of `ray start`
            _check_ray(["start", *words], ray_commands, "ports")
    assert set(starts) == {"head", "rollout"}
    (run,) = runs
    cfg = load_config(ROOT / run[0], [w for w in run[1:] if not w.startswith("--")])
    head_gcs = f"{starts['rollout']['--address'].split(':')[0]}:{starts['head']['--port']}"
    assert cfg.ray.address == head_gcs
    # what each machine advertises holds what the config puts on it
    head_res = json.loads(starts["head"]["--resources"])
    rollout_res = json.loads(starts["rollout"]["--resources"])
    t, r = cfg.trainer, cfg.rollout
    for k, v in t.resources.items():
        assert head_res.get(k, 0) >= v * t.ranks, "the head hosts every trainer rank"
    assert float(starts["head"]["--num-cpus"]) >= t.cpus_per_rank * t.ranks
    per_machine = min(rollout_res.get(k, 0) // v for k, v in r.resources.items())
    assert per_machine >= 1
    assert float(starts["rollout"]["--num-cpus"]) >= r.cpus_per_node * per_machine
    assert not set(r.resources) & set(head_res), "rollout nodes stay off the head"


# --- slurm/rollcall.sbatch ---------------------------------------------------------------------

_STUBS = {
    "scontrol": """#!/bin/bash
[ "$1 $2" = "show hostnames" ] && printf '%s\\n' $FAKE_NODES
""",
    # srun [options] -w HOST CMD...: logs what it got, then becomes CMD (same pid: the script's
    # kill reaches it)
    "srun": """#!/bin/bash
opts=
while [ $# -gt 0 ]; do
    case $1 in
        -w) export FAKE_HOST=$2; shift 2 ;;
        -*) opts="$opts $1"; shift ;;
        *) break ;;
    esac
done
# one write per line: the nodes' sruns append to one log at once (O_APPEND keeps a single
# write whole; a line written in pieces was seen interleaved with another node's)
line=$(printf 'srun\\t%s\\t%s\\t' "$FAKE_HOST" "$opts"; printf '%q ' "$@")
printf '%s\\n' "$line" >> "$FAKE_LOG"
exec "$@"
""",
    # ray start: logs its pid and environment and blocks; ray status: the nodes started so
    # far, at most FAKE_ALIVE
    "ray": """#!/bin/bash
case $1 in
    start)
        echo "ray start $FAKE_HOST pid=$$ auth=$RAY_AUTH_MODE token=${#RAY_AUTH_TOKEN}" \\
             "nice=$RAY_worker_niceness db=${ROLLCALL_DATABASE_URL:-none}" >> "$FAKE_LOG"
        exec sleep 600 ;;
    status)
        n=$(grep -c '^ray start ' "$FAKE_LOG" 2>/dev/null)
        n=${n:-0}
        [ "$n" -le "$FAKE_ALIVE" ] || n=$FAKE_ALIVE
        echo Active:
        for i in $(seq "$n"); do echo " 1 node_$i"; done
        printf 'Pending:\\n (no pending nodes)\\n' ;;
esac
""",
    "rollcall": """#!/bin/bash
echo "rollcall auth=$RAY_AUTH_MODE token=${#RAY_AUTH_TOKEN} db=${ROLLCALL_DATABASE_URL:-none}" \\
    >> "$FAKE_LOG"
printf '%s\\n' "$@" > "$FAKE_ARGS"
exit "${FAKE_RC:-0}"
""",
}


def _sbatch_options() -> dict[str, str]:
    text = SBATCH.read_text()
    return dict(re.findall(r"(?m)^#SBATCH --([\w-]+)=(\S+)", text))


def _run_sbatch(tmp_path: Path, *args: str, **fake: str) -> tuple[int, str, list[str], str]:
    """Run the script as Slurm would on an allocation of its #SBATCH shape, with stand-ins
    for srun, scontrol, ray and rollcall. Returns its exit code, the stand-ins' log, the
    arguments rollcall got and the script's stderr, once every `ray start` it began is gone."""
    opts = _sbatch_options()
    nodes = [f"n{i}" for i in range(int(opts["nodes"]))]
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name, body in _STUBS.items():
        stub = venv / "bin" / name
        stub.write_text(body)
        stub.chmod(0o755)
    (tmp_path / "production.env").write_text("ROLLCALL_DATABASE_URL=postgresql://u:pw@db/r\n")
    log, argv = tmp_path / "log", tmp_path / "args"
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "VENV": str(venv),
        "ROLLCALL_ENV": str(tmp_path / "production.env"),
        "HEAD_IP": "10.0.0.1",
        "RAY_POLL_S": "0.05",
        "SLURM_JOB_NODELIST": "n[0-9]",
        "SLURMD_NODENAME": nodes[0],
        "SLURM_CPUS_PER_TASK": opts["cpus-per-task"],
        "SLURM_GPUS_PER_NODE": opts["gpus-per-node"],
        "FAKE_NODES": " ".join(nodes),
        "FAKE_ALIVE": str(len(nodes)),
        "FAKE_LOG": str(log),
        "FAKE_ARGS": str(argv),
        **fake,
    }
    # a `ray start` left running would hold the pipes open: the run would time out
    p = subprocess.run(
        ["bash", str(SBATCH), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    text = log.read_text() if log.exists() else ""
    for pid in re.findall(r"(?m)^ray start \S+ pid=(\d+)", text):
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)  # stopped, and reaped by the script
    args_seen = argv.read_text().splitlines() if argv.exists() else []
    return p.returncode, text, args_seen, p.stderr


needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@needs_bash
def test_slurm_script_parses() -> None:
    p = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert os.access(SBATCH, os.X_OK)


@needs_bash
def test_slurm_script_starts_ray_runs_the_job_and_stops_ray(tmp_path: Path) -> None:
    rc, log, args, err = _run_sbatch(tmp_path, "--resume")
    assert rc == 0, err + log
    opts = _sbatch_options()
    n = int(opts["nodes"])
    steps = [line.split("\t")[1:] for line in log.splitlines() if line.startswith("srun\t")]
    assert sorted(host for host, _, _ in steps) == [f"n{i}" for i in range(n)]
    pools = []
    for host, step, command in steps:
        # each step holds all of its node's CPUs and GPUs
        assert f"--cpus-per-task={opts['cpus-per-task']}" in step.split()
        assert f"--gpus-per-node={opts['gpus-per-node']}" in step.split()
        words = shlex.split(command)
        assert words[:2] == ["ray", "start"] and "--block" in words
        flags = dict(w.split("=", 1) for w in words if "=" in w)
        if host == "n0":
            assert "--head" in words and flags["--port"] == "6379"
            assert flags["--dashboard-host"] == "127.0.0.1"
        else:
            assert flags["--address"] == "10.0.0.1:6379"
        res = {**json.loads(flags["--resources"]), "CPU": float(flags["--num-cpus"])}
        pools.append((1, {**res, "GPU": float(opts["gpus-per-node"])}))
    # rollcall ran once every node was up, with a job that fits what was started
    assert log.index("rollcall ") > max(m.start() for m in re.finditer("(?m)^ray start ", log))
    sub, config, *rest = args
    assert sub == "run" and rest[-2:] == ["--no-live", "--resume"]
    cfg = load_config(ROOT / config, rest[:-2])
    assert cfg.ray.address == "10.0.0.1:6379"
    _fits(cfg, pools)
    # Ray on every node with this job's token and niceness 0, without the database secret;
    # the driver with both
    ray_envs = re.findall(r"(?m)^ray start \S+ pid=\d+ (.*)$", log)
    assert ray_envs == ["auth=token token=64 nice=0 db=none"] * n
    assert "rollcall auth=token token=64 db=postgresql://u:pw@db/r" in log


@needs_bash
def test_slurm_script_exit_codes(tmp_path: Path) -> None:
    # rollcall's exit code is the batch job's (7: no rollout node could run), Ray stopped
    rc, _, _, _ = _run_sbatch(tmp_path / "a", FAKE_RC="7")
    assert rc == 7
    # nodes that do not join in time: no job, a line saying how many did, Ray stopped (on a
    # loaded machine the head itself may be later than 1 s: then it is "0 of 1")
    rc, _, args, err = _run_sbatch(tmp_path / "b", FAKE_ALIVE="2", RAY_WAIT_S="1")
    assert rc == 1 and not args
    n = _sbatch_options()["nodes"]
    assert re.search(rf"rollcall: (2 of {n}|0 of 1) Ray nodes up after 1s", err), err
