"""Experiment trackers with their real packages, offline: TensorBoard event files, a wandb
offline run and an MLflow sqlite store get the steps, the evaluations with their intervals, the
config and the learning curve; a second start (a resumed job) continues the same runs; a
tracker that fails is dropped without stopping the job; a missing package refuses the start."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from rollcall.orchestrator.config import RunConfig
from rollcall.orchestrator.errors import UserError
from rollcall.orchestrator.runner.rundir import RunDir
from rollcall.orchestrator.runner.trackers import Trackers, scalars_of
from tests.support import trackers as read

ALL = ["tensorboard", "wandb", "mlflow"]


def _run_config(trackers: list[str]) -> RunConfig:
    return RunConfig.model_validate(
        {"trackers": trackers, "tracking": {"project": "rc-test", "wandb_mode": "offline"}}
    )


def _step(step: int) -> dict[str, Any]:
    return {"kind": "step", "step": step, "loss": 1.0 / (step + 1), "reward/calc": 0.1 * step,
            "replayed": False, "checkpoint_uri": "/x", "expired_groups": {}}  # fmt: skip


def _eval(step: int) -> dict[str, Any]:
    return {"kind": "eval", "step": step, "reward": {"calc": 0.5},
            "rewards": {"calc": [0.0, 1.0, 0.5, 0.5]}}  # fmt: skip


def _start(root: Path, names: list[str], said: list[str]) -> RunDir:
    run_dir = RunDir(root)
    run_dir.write_config({"job": {"name": "tracked"}, "run": {"mode": "async"}})
    run_dir.start_trackers(_run_config(names), "tracked", said.append)
    return run_dir


def test_scalars_of_records() -> None:
    assert scalars_of(_step(2)) == ("train", 2, {"train/loss": 1 / 3, "train/reward/calc": 0.2})
    section, step, values = scalars_of(_eval(4)) or ("", 0, {})
    assert (section, step) == ("eval", 4) and values["eval/calc/reward"] == 0.5
    assert values["eval/calc/low"] < 0.5 < values["eval/calc/high"]
    assert scalars_of({"kind": "step"}) is None


def test_three_trackers_offline_and_a_resumed_run_continues_them(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import openai  # noqa: F401  (an agent task's client: wandb would advertise Weave for it)

    cwd = tmp_path / "elsewhere"  # where the job was started: nothing may land there
    cwd.mkdir()
    monkeypatch.chdir(cwd)

    said: list[str] = []
    run_dir = _start(tmp_path, ALL, said)
    run_dir.append(_eval(0))
    for s in (0, 1):
        run_dir.append(_step(s))
    run_dir.close_trackers()
    # the resumed job: a new start on the same run directory
    run_dir = _start(tmp_path, ALL, said)
    run_dir.append(_step(2))
    run_dir.append(_eval(3))
    assert run_dir.plot("tracked") is not None  # the learning curve goes to the trackers too
    run_dir.close_trackers()
    assert said == []
    terminal = capfd.readouterr()  # the trackers' own chatter stays off the terminal
    assert "wandb:" not in terminal.out + terminal.err
    assert "INFO mlflow" not in terminal.out + terminal.err

    tb = read.tensorboard(tmp_path / "tensorboard")
    assert [s for s, _ in tb["scalars"]["train/loss"]] == [0, 1, 2]
    assert [s for s, _ in tb["scalars"]["eval/calc/reward"]] == [0, 3]
    assert "eval/calc/low" in tb["scalars"] and "eval/calc/high" in tb["scalars"]
    assert "train/replayed" not in tb["scalars"]  # booleans and strings are not metrics
    assert "config" in tb["text"] and "learning_curve" in tb["images"]

    (ml,) = read.mlflow_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "rc-test")
    assert ml["name"] == "tracked" and ml["status"] == "FINISHED"
    assert [s for s, _ in ml["metrics"]["train/loss"]] == [0, 1, 2]
    assert [s for s, _ in ml["metrics"]["eval/calc/high"]] == [0, 3]
    assert ml["params"]["run.mode"] == "async"
    assert {"config.yaml", "learning_curve.png"} <= set(ml["artifacts"])
    assert list(cwd.iterdir()) == []  # MLflow's artifacts are in the run directory
    assert list((tmp_path / "mlflow-artifacts").glob("*/artifacts/learning_curve.png"))

    first, second = read.wandb_runs(tmp_path / "wandb")
    assert first["id"] == second["id"] and first["name"] == "tracked"
    assert first["project"] == "rc-test" and {"job", "run"} <= first["config"]
    steps = [r["train/step"] for r in first["history"] + second["history"] if "train/step" in r]
    assert steps == [0, 1, 2]
    evals = [r for r in second["history"] if "eval/calc/low" in r]
    assert [r["eval/step"] for r in evals] == [3]


class _Breaking:
    """A fake tracker that raises on its second record (a tracker server going away)."""

    name = "breaking"

    def __init__(self) -> None:
        self.calls = 0

    def config(self, config: dict[str, Any], text: str) -> None:
        pass

    def scalars(self, section: str, step: int, values: dict[str, float]) -> None:
        self.calls += 1
        if self.calls == 2:
            raise ConnectionError("tracker server gone")

    def image(self, tag: str, step: int, path: Path) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_failing_tracker_is_dropped_and_the_others_go_on(tmp_path: Path) -> None:
    from rollcall.orchestrator.runner.trackers import TensorBoardTracker

    said: list[str] = []
    breaking = _Breaking()
    trackers = Trackers([breaking, TensorBoardTracker(tmp_path / "tb")], said.append)
    for s in range(4):
        trackers.record(_step(s))
    trackers.close()
    assert breaking.calls == 2
    assert said == ["tracker breaking: ConnectionError (step 1); dropped, see driver.log"]
    assert [s for s, _ in read.tensorboard(tmp_path / "tb")["scalars"]["train/loss"]] == [
        0,
        1,
        2,
        3,
    ]


def test_a_tracker_not_installed_refuses_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: import fails
    with pytest.raises(UserError, match=r"names wandb, which is not installed .*rollcall\[wandb\]"):
        _start(tmp_path, ["tensorboard", "wandb"], [])
    assert not (tmp_path / "trackers.json").exists()


def test_trackers_config_is_checked() -> None:
    with pytest.raises(ValueError, match="names a tracker twice"):
        _run_config(["wandb", "wandb"])
    with pytest.raises(ValueError):
        _run_config(["neptune"])
    assert RunConfig().trackers == ["tensorboard"]


class FakeMlflowClient:
    """A fake of ``mlflow.MlflowClient`` for a tracking server with a password in its URI
    (no MLflow server runs here): records the runs it creates and resumes."""

    created: ClassVar[list[str]] = []
    resumed: ClassVar[list[str]] = []

    def __init__(self, tracking_uri: str) -> None:
        self.uri = tracking_uri

    def get_experiment_by_name(self, name: str) -> Any:
        return None

    def create_experiment(self, name: str, artifact_location: str | None = None) -> str:
        return "1"

    def create_run(self, experiment_id: str, run_name: str) -> Any:
        from types import SimpleNamespace

        self.created.append(run_name)
        return SimpleNamespace(info=SimpleNamespace(run_id="r1"))

    def update_run(self, run_id: str, status: str) -> None:
        self.resumed.append(run_id)


def test_an_mlflow_password_stays_out_of_the_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """trackers.json remembers which store the run is in (a resume continues it there) by its
    URI with the password masked; the same store is recognised on the next start."""
    import mlflow

    from rollcall.orchestrator.config import TrackingConfig
    from rollcall.orchestrator.runner.trackers import MlflowTracker

    monkeypatch.setattr(mlflow, "MlflowClient", FakeMlflowClient)
    cfg = TrackingConfig(mlflow_uri="https://rollcall:s3cret@mlflow.example:5000")
    ids: dict[str, Any] = {}
    first = MlflowTracker(cfg, tmp_path, "tracked", ids)
    client: Any = first.client
    assert first.fresh and client.uri == cfg.mlflow_uri  # the server gets the password
    assert "s3cret" not in repr(ids) and ids["mlflow"]["run_id"] == "r1"
    again = MlflowTracker(cfg, tmp_path, "tracked", ids)  # a resumed job: the same run
    assert not again.fresh and again.run_id == "r1"
    assert FakeMlflowClient.created == ["tracked"] and FakeMlflowClient.resumed == ["r1"]
