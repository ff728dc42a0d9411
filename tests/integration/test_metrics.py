"""The Prometheus endpoint: its families equal the catalogue (``METRICS``), its values equal the
buffer's state, they move as the job moves, it survives the database going away, binds to the
loopback interface by default, and shows no payloads; and a real short job scraped while it
runs."""

from __future__ import annotations

import re
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from rollcall.orchestrator.db.engine import Database, normalise_url
from rollcall.orchestrator.domain import SLOT_STATES
from rollcall.orchestrator.runner.driver import JobDriver
from rollcall.orchestrator.runner.metrics import DRILLS, JOB, METRICS, MetricsExporter
from rollcall.orchestrator.settings import resolve_database
from tests.integration.buffer_helpers import add_tasks, drain_queue, finish, make_buffer, rows

STATES = {"queued", "leased", "ready", "claimed", "consumed", "expired", "quarantined"}


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.status == 200
        return str(r.read().decode())


def parse(text: str) -> dict[str, Any]:
    """family name (as in the catalogue: counters with ``_total``) -> family."""
    out = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name + ("_total" if fam.type == "counter" else "")] = fam
    return out


def values(fams: dict[str, Any], sample: str, **labels: str) -> list[float]:
    """The samples named ``sample`` whose labels include ``labels``."""
    family = re.sub(r"_(bucket|sum|count)$", "", sample)
    fam = fams[family if family in fams else sample]
    return [
        float(s.value)
        for s in fam.samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def value(fams: dict[str, Any], sample: str, **labels: str) -> float:
    """The one sample named ``sample`` whose labels include ``labels``."""
    found = values(fams, sample, **labels)
    assert len(found) == 1, (sample, labels, fams.get(sample))
    return found[0]


def check_labels(fams: dict[str, Any], allowed: dict[str, set[str] | re.Pattern[str]]) -> None:
    """Every sample carries exactly its family's labels, with values from ``allowed`` (no
    payload can hide in a label)."""
    for name, fam in fams.items():
        spec = METRICS[name]
        for s in fam.samples:
            extra = {"le"} if spec.kind == "histogram" and s.name.endswith("_bucket") else set()
            assert set(s.labels) == set(spec.labels) | extra, (s.name, s.labels)
            for k, v in s.labels.items():
                rule = allowed.get(k)
                ok = (
                    v in rule
                    if isinstance(rule, set)
                    else bool(rule.fullmatch(v))
                    if rule is not None
                    else k == "le"
                )
                assert ok, (s.name, k, v)


def _state(db: Database) -> Any:
    add_tasks(
        db,
        {"name": "a", "weight": 2, "max_inflight": 4, "max_staleness": 2},
        {"name": "b", "weight": 1, "max_inflight": 4, "max_staleness": 2},
    )
    buf = make_buffer(db, batch_groups=2)
    buf.seed()
    w = buf.register_worker("rollout-0")
    for _ in range(3):
        c = buf.claim(w.id)
        assert c is not None
        finish(buf, c, version=0, reward=0.5)
    buf.claim_batch(0, min_groups=2)
    buf.commit_step(0, metrics={"reward/a": 0.5, "train_s": 1.0})
    held = buf.claim(w.id)
    assert held is not None
    buf.beat(w.id, tokens_generated=64, loaded_version=1)
    for passed, lost in ((True, 0), (False, 2)):
        buf.event(
            "drill.completed",
            "test drill",
            {
                "drill": "kill-rollout --signal KILL",
                "passed": passed,
                "lost": lost,
                "duplicated": 0,
            },
        )
    return buf, w, held


def test_exporter_matches_the_catalogue_and_the_buffer(db: Database, engine: sa.Engine) -> None:
    buf, w, held = _state(db)
    exporter = MetricsExporter(db, 1, "default", checkpoint_every=1, publish_every=2)
    exporter.refresh()
    url = exporter.serve("127.0.0.1", 0)
    try:
        assert exporter.server.server_address[0] == "127.0.0.1"
        text = scrape(url)
        fams = parse(text)
        assert set(fams) == set(METRICS)  # every family of the catalogue, nothing else
        for name, fam in fams.items():
            assert fam.type == METRICS[name].kind, name
        check_labels(
            fams,
            {
                JOB: {"default"},
                "task": {"a", "b"},
                "status": STATES,
                "node": {"rollout-0"},
                "role": {"rollout"},
                "kind": {"task.registered", "drill.completed"},
                "drill": set(DRILLS),
                "result": {"passed", "failed"},
                "state": set(SLOT_STATES),
            },
        )
        # no payloads: prompts, the database's address
        for (prompt,) in rows(engine, "SELECT prompt FROM episodes"):
            assert prompt["text"] not in text and prompt["target"] not in text
        assert "postgres" not in text and "/tmp" not in text

        # values equal the buffer's own counts
        assert value(fams, "rollcall_database_up") == 1
        assert value(fams, "rollcall_policy_version") == 1
        assert value(fams, "rollcall_train_steps_total") == 1
        counts = {
            (t, s): n
            for t, s, n in rows(
                engine,
                """SELECT t.name, CASE WHEN e.status = 'done' AND e.consumed_step IS NOT NULL
                                      THEN 'consumed' WHEN e.status = 'done' THEN 'ready'
                                      ELSE e.status::text END, count(*)
                   FROM episodes e JOIN tasks t ON t.id = e.task_id GROUP BY 1, 2""",
            )
        }
        for task in ("a", "b"):
            for state in STATES:
                got = value(fams, "rollcall_buffer_episodes", task=task, status=state)
                assert got == counts.get((task, state), 0), (task, state)
            consumed = counts.get((task, "consumed"), 0)
            assert value(fams, "rollcall_task_trained_groups_total", task=task) == consumed
            assert value(fams, "rollcall_task_trained_samples_total", task=task) == 2 * consumed
            # trained at step 0 from version 0: staleness 0, in the first bucket
            assert value(fams, "rollcall_staleness_versions_bucket", task=task, le="0.0") == (
                consumed
            )
            assert value(fams, "rollcall_staleness_versions_count", task=task) == consumed
        assert value(fams, "rollcall_task_inflight_episodes", task=held.task_name) == 1
        assert value(fams, "rollcall_task_quota_ratio", task="a") == pytest.approx(2 / 3)
        assert value(fams, "rollcall_task_reward", task="a") == 0.5
        assert value(fams, "rollcall_node_up", node="rollout-0", role="rollout") == 1
        assert value(fams, "rollcall_node_tokens_generated_total", node="rollout-0") == 64
        assert value(fams, "rollcall_node_version_lag_versions", node="rollout-0") == 0
        assert value(fams, "rollcall_drills_total", drill="kill-rollout", result="failed") == 1
        assert value(fams, "rollcall_drill_lost_samples_total", drill="kill-rollout") == 2
        assert value(fams, "rollcall_drills_total", drill="kill-node", result="failed") == 0
        # steps committed before the exporter started are not timed
        assert value(fams, "rollcall_trainer_step_seconds_count") == 0

        # the job moves: another step, timed; its publication (step 2 of publish_every 2)
        finish(buf, held, version=1)
        drain_queue(buf, w.id, version=1)
        assert buf.claim_batch(1, min_groups=2).groups
        phases = {"plan_s": 0.5, "train_s": 2.0, "checkpoint_s": 0.25, "publish_s": 0.75}
        buf.commit_step(1, metrics=phases)
        exporter.refresh()
        fams = parse(scrape(url))
        assert value(fams, "rollcall_policy_version") == 2
        assert value(fams, "rollcall_train_steps_total") == 2
        assert value(fams, "rollcall_trainer_step_seconds_count") == 1
        assert value(fams, "rollcall_trainer_step_seconds_sum") == 3.5
        assert value(fams, "rollcall_trainer_step_seconds_bucket", le="2.5") == 0
        assert value(fams, "rollcall_trainer_step_seconds_bucket", le="5.0") == 1
        assert value(fams, "rollcall_weight_publish_seconds_sum") == 0.75
        assert value(fams, "rollcall_checkpoint_save_seconds_count") == 1
        assert 0 < value(fams, "rollcall_trainer_busy_ratio") <= 1
        assert value(fams, "rollcall_node_version_lag_versions", node="rollout-0") == 1
        trained = sum(value(fams, "rollcall_task_trained_groups_total", task=t) for t in ("a", "b"))
        assert trained == 4

        # the database goes away: up drops to 0, the last values stay, errors are counted
        exporter.db = Database(
            normalise_url("postgresql://nobody@127.0.0.1:9/none"), resolve_database("x")
        )
        exporter.refresh()
        fams = parse(scrape(url))
        assert value(fams, "rollcall_database_up") == 0
        assert value(fams, "rollcall_collect_errors_total") == 1
        assert value(fams, "rollcall_policy_version") == 2
    finally:
        exporter.close()
    with pytest.raises(OSError):
        scrape(url)


@pytest.mark.timeout(600)
def test_metrics_scraped_during_a_short_job(
    ray_local: Any, tiny_dir: Path, db: Database, engine: sa.Engine, tmp_path: Path
) -> None:
    from rollcall.orchestrator.services.status import status_document
    from tests.integration.test_job import _config

    cfg = _config(tmp_path, tiny_dir, total_steps=3)
    cfg = cfg.model_copy(
        update={
            "metrics": cfg.metrics.model_copy(
                update={"enabled": True, "port": 0, "interval_s": 0.5}
            )
        }
    )
    driver = JobDriver(
        cfg, db, model_dir=tiny_dir, home=tmp_path, console=Console(file=None), live=False
    )
    scrapes: list[str] = []
    statuses: list[dict[str, Any]] = []
    stop = threading.Event()

    def poll(url: str) -> None:
        while not stop.is_set():
            try:
                scrapes.append(scrape(url))
                if not statuses:
                    with db.transaction() as tx:
                        statuses.append(status_document(tx, "e2e"))
            except OSError:
                pass
            stop.wait(0.3)

    try:
        driver.setup()
        url = driver.metrics.url
        assert url.startswith("http://127.0.0.1:")  # the default host
        t = threading.Thread(target=poll, args=(url,), daemon=True)
        t.start()
        result = driver.run()
        stop.set()
        t.join(timeout=5)
        # one collection after the run: the stopped rollout node must read as down (the
        # poller's last scrape may have come before the exporter's next refresh)
        driver.metrics.refresh()
        scrapes.append(scrape(url))
    finally:
        stop.set()
        driver.close()
    assert result.steps == 3
    with pytest.raises(OSError):
        scrape(url)  # closed with the driver
    series = [parse(s) for s in scrapes]
    assert len(series) >= 3
    # the first and the last scrape while the rollout node was up (it registers before the
    # first step can be trained; the driver stops it at the end, then evaluates and saves)
    up = [f for f in series if values(f, "rollcall_node_up", node="rollout-0") == [1.0]]
    first, last = up[0], up[-1]
    for fams in (first, last):
        assert set(fams) == set(METRICS)
        check_labels(
            fams,
            {
                JOB: {"e2e"},
                "task": {"calc", "guess"},
                "status": STATES,
                "node": {"rollout-0", "trainer-0"},
                "role": {"rollout", "trainer"},
                "kind": re.compile(r"[a-z]+\.[a-z_]+"),
                "drill": set(DRILLS),
                "result": {"passed", "failed"},
                "state": set(SLOT_STATES),
                "scheduler_job": {
                    "seed",
                    "lease-sweep",
                    "staleness-expiry",
                    "dead-worker-sweep",
                    "supervise",
                    "payload-retention",
                    "user-errors",
                    "metrics",
                },
            },
        )
    # moving: steps, trained samples, the rollout node's tokens, the trainer's timed steps
    assert value(last, "rollcall_train_steps_total") > value(first, "rollcall_train_steps_total")
    for task in ("calc", "guess"):
        assert value(last, "rollcall_task_trained_samples_total", task=task) >= value(
            first, "rollcall_task_trained_samples_total", task=task
        )
    trained = sum(
        value(last, "rollcall_task_trained_samples_total", task=t) for t in ("calc", "guess")
    )
    assert 0 < trained <= rows(engine, "SELECT sum(num_trajectories) FROM train_steps")[0][0]
    assert value(last, "rollcall_node_tokens_generated_total", node="rollout-0") > value(
        first, "rollcall_node_tokens_generated_total", node="rollout-0"
    )
    # cumulative trainer timings: the final collection has every step (the last scrape with the
    # node up can come before the exporter saw the second step when steps finish back to back)
    assert value(series[-1], "rollcall_trainer_step_seconds_count") >= 2
    assert value(last, "rollcall_node_up", node="trainer-0", role="trainer") == 1
    assert value(series[-1], "rollcall_node_up", node="rollout-0", role="rollout") == 0
    # the rollout node loaded new weights after the steps, and reported the latency (reports
    # arrive a collection late: the final scrape has the node's last one)
    assert value(series[-1], "rollcall_weight_load_seconds_count", node="rollout-0") >= 1
    assert value(series[-1], "rollcall_weight_load_seconds_sum", node="rollout-0") > 0
    assert value(series[-1], "rollcall_weight_publish_seconds_count") >= 2
    # the importance weight of the last step, and the on-policy one at 1 (the hf engine and
    # the trainer in float32 agree): no drift warning
    assert abs(value(series[-1], "rollcall_is_weight_mean") - 1) < 0.2
    assert abs(value(series[-1], "rollcall_is_weight_onpolicy_geomean") - 1) < 1e-3
    assert not values(series[-1], "rollcall_events_total", kind="trainer.is_weight_drift")
    # status during the job: running, and it names the endpoint
    assert statuses and statuses[0]["job"]["running"] is True
    assert statuses[0]["job"]["metrics_url"] == url
    # metadata retention on the ended job (every step but the last, the hour's guard off):
    # status, metrics, depth and invariants read the same from the totals
    from rollcall.orchestrator.buffer.control import ControlPlaneBuffer
    from rollcall.orchestrator.config import BufferConfig
    from tests.integration.test_compaction import picture

    job_id = rows(engine, "SELECT id FROM jobs WHERE name = 'e2e'")[0][0]
    before = picture(db, job_id, "e2e")
    assert not any(before["invariants"].values())
    control = ControlPlaneBuffer(db, job_id, BufferConfig(metadata_retention_steps=1))
    assert control.compact_metadata(min_age_s=0) > 0
    assert picture(db, job_id, "e2e") == before


class _ReportingNode:
    """A fake rollout node (named as such): a Ray actor with only the node's ``report`` call,
    whose first answer waits for a flag file, as a busy node answers late."""

    def __init__(self, worker_id: int, gate: str) -> None:
        self.worker_id, self.gate, self.calls = worker_id, gate, 0

    def report(self) -> dict[str, Any]:
        import time

        self.calls += 1
        seq, loads = self.calls, 0  # the first report is taken before any weight load
        while seq == 1 and not Path(self.gate).exists():
            time.sleep(0.05)
        return {
            "worker_id": self.worker_id,
            "report_seq": seq,
            "weight_loads": loads,
            "weight_load_s_total": 0.0,
            "weight_load_s_last": 0.0,
        }


def test_a_late_report_never_replaces_a_newer_one(
    ray_local: Any, db: Database, tmp_path: Path
) -> None:
    """A node's report asked for before a weight load and answered after the driver handed
    the exporter a newer one (fetched after a step) is older: it must not replace it."""
    import ray

    _, w, _ = _state(db)
    gate = tmp_path / "answer"
    actor = ray.remote(num_cpus=0, max_concurrency=2)  # type: ignore[call-overload]
    node = actor(_ReportingNode).remote(w.id, str(gate))
    exporter = MetricsExporter(
        db, 1, "default", checkpoint_every=1, publish_every=2, node_actors=lambda: [node]
    )
    exporter.refresh()  # asks the node; its answer is late
    newer = {
        "worker_id": w.id,
        "report_seq": 7,
        "weight_loads": 2,
        "weight_load_s_total": 0.5,
        "weight_load_s_last": 0.2,
    }
    exporter.take_reports([newer])  # the driver's, after a step
    gate.touch()
    ray.get(node.report.remote(), timeout=60)  # the late answer has been given
    exporter.refresh()  # collects the late answer
    fams = parse(generate_latest(exporter.registry).decode())
    assert value(fams, "rollcall_weight_load_seconds_count", node="rollout-0") == 2
    assert value(fams, "rollcall_weight_load_seconds_sum", node="rollout-0") == 0.5
