"""Reading back what the experiment trackers wrote, offline, with each tracker's own package:
TensorBoard's event files (its EventAccumulator), an MLflow store (its client) and a wandb
offline run folder (its protobuf records, in the folder's log file)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any


def tensorboard(logdir: Path) -> dict[str, Any]:
    """{"scalars": {tag: [(step, value), ...]}, "text": [tags], "images": [tags]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags["scalars"]}
    # add_text is stored as a tensor summary named TAG/text_summary
    text = [t.removesuffix("/text_summary") for t in tags["tensors"]]
    return {"scalars": scalars, "text": text, "images": list(tags["images"])}


def mlflow_runs(uri: str, experiment: str) -> list[dict[str, Any]]:
    """Each run of ``experiment``: name, status, params, and metric histories [(step, value)]."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r} in {uri}"
    out = []
    for run in client.search_runs([exp.experiment_id]):
        rid = run.info.run_id
        out.append(
            {
                "id": rid,
                "name": run.info.run_name,
                "status": run.info.status,
                "params": run.data.params,
                "metrics": {
                    k: sorted((m.step, m.value) for m in client.get_metric_history(rid, k))
                    for k in run.data.metrics
                },
                "artifacts": sorted(a.path for a in client.list_artifacts(rid)),
            }
        )
    return out


_BLOCK = 32 * 1024  # the LevelDB log format wandb writes its run file in
_HEADER = 7  # crc32c (4), length (2), type (1)


def _records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    pos, out, partial = 7, [], b""
    while pos + _HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _HEADER:  # the block's tail is padding
            pos += room
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if kind == 0 and length == 0:
            break  # zero-filled: the end
        body = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        partial += body
        if kind in (1, 4):  # FULL, LAST
            out.append(partial)
            partial = b""
    return out


def wandb_runs(folder: Path) -> list[dict[str, Any]]:
    """Each offline run in ``folder`` (a ``wandb`` directory), oldest first: its id, name,
    project, config keys and history rows ({key: value})."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = []
    for run_dir in sorted(folder.glob("offline-run-*")):
        (run_file,) = run_dir.glob("run-*.wandb")
        info: dict[str, Any] = {"history": [], "config": set()}
        for raw in _records(run_file):
            rec = pb.Record()
            rec.ParseFromString(raw)
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                info.update(id=rec.run.run_id, name=rec.run.display_name, project=rec.run.project)
                info["config"] |= {u.key for u in rec.run.config.update}
            elif kind == "config":
                info["config"] |= {u.key for u in rec.config.update}
            elif kind == "history":
                row = {}
                for item in rec.history.item:
                    key = item.key or "/".join(item.nested_key)
                    row[key] = json.loads(item.value_json)
                info["history"].append(row)
        runs.append(info)
    return runs
