"""The job's Prometheus metrics, exported by the job driver (``metrics:`` in the config).

``MetricsExporter`` is a prometheus-client collector over a snapshot that a control-plane
scheduler job refreshes every ``metrics.interval_s``: the numbers come from the database
(``rollcall.orchestrator.services.status.snapshot``: tasks, buffer, workers, steps, events, drills),
the trainer's step timings from the ``train_steps`` rows committed since the exporter started, and
the rollout nodes' weight-load latency from their own reports (a Ray call with a short
timeout). A scrape never touches the database. When the database cannot be reached,
``rollcall_database_up`` drops to 0 and the last collected values stay.

What the endpoint shows: numbers and labels only (job, task, node and slot names, roles,
statuses, event kinds, drill names), never prompts, tokens, rewards of single samples, URLs or
credentials. It binds to ``metrics.host`` (127.0.0.1 unless configured).

``METRICS`` is the catalogue: every family the endpoint exports, with its type and labels. The
dashboards and alert rules in ``ops/`` are tested against it, and the exporter's output is
tested to match it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

from rollcall.orchestrator.config import RollcallConfig
from rollcall.orchestrator.db.engine import Database
from rollcall.orchestrator.db.retry import is_transient
from rollcall.orchestrator.domain import SLOT_STATES
from rollcall.orchestrator.errors import UserError
from rollcall.orchestrator.services.status import (
    EPISODE_STATES,
    JobSnapshot,
    snapshot,
    step_seconds,
)

log = logging.getLogger(__name__)

JOB = "rollcall_job"  # not "job": Prometheus sets its own ``job`` label on every target


@dataclass(frozen=True)
class Spec:
    kind: str  # gauge | counter | histogram | summary
    labels: tuple[str, ...]
    help: str


_J = (JOB,)
_T = (JOB, "task")
_N = (JOB, "node", "role")
_R = (JOB, "node")

METRICS: dict[str, Spec] = {
    # the exporter itself and the database
    "rollcall_database_up": Spec("gauge", _J, "1 when the last collection reached the database"),
    "rollcall_collect_timestamp_seconds": Spec(
        "gauge", _J, "Unix time of the last successful collection"
    ),
    "rollcall_collect_errors_total": Spec("counter", _J, "collections that failed"),
    "rollcall_scheduler_missed_runs_total": Spec(
        "counter",
        (JOB, "scheduler_job"),
        "control-plane runs dropped: started later than their misfire grace (in driver.log)",
    ),
    # job and trainer
    "rollcall_policy_version": Spec("gauge", _J, "the job's policy version (committed steps)"),
    "rollcall_weights_version": Spec("gauge", _J, "the latest published weights version"),
    "rollcall_train_steps_total": Spec("counter", _J, "train steps committed"),
    "rollcall_last_step_age_seconds": Spec("gauge", _J, "seconds since the last step commit"),
    "rollcall_trainer_busy_ratio": Spec(
        "gauge", _J, "trainer busy time over wall time, last 10 steps"
    ),
    "rollcall_trainer_step_seconds": Spec(
        "histogram", _J, "trainer seconds per step (plan, train, checkpoint, publish)"
    ),
    "rollcall_checkpoint_save_seconds": Spec("histogram", _J, "seconds to save a checkpoint"),
    "rollcall_weight_publish_seconds": Spec("histogram", _J, "seconds to publish new weights"),
    "rollcall_trainer_restarts_total": Spec("counter", _J, "trainer group restarts"),
    "rollcall_trainer_start_failures_total": Spec(
        "counter", _J, "trainer (re)starts that failed (not placed, or not set up, in time)"
    ),
    "rollcall_is_weight_mean": Spec(
        "gauge", _J, "mean importance weight pi_old / pi_behaviour, last step's trained tokens"
    ),
    "rollcall_is_weight_onpolicy_geomean": Spec(
        "gauge",
        _J,
        "geometric mean pi_old / pi_behaviour, last step's on-policy tokens (1: rollout and "
        "trainer agree)",
    ),
    # tasks: quota, mix, throughput, reward
    "rollcall_task_weight": Spec("gauge", _T, "the task's quota weight"),
    "rollcall_task_quota_ratio": Spec("gauge", _T, "weight / total weight of the job's tasks"),
    "rollcall_task_mix_ratio": Spec("gauge", _T, "share of groups trained, last 10 steps"),
    "rollcall_task_active": Spec("gauge", _T, "1 when the task is active (not paused, draining)"),
    "rollcall_task_max_inflight": Spec("gauge", _T, "the task's in-flight cap (episodes)"),
    "rollcall_task_inflight_episodes": Spec("gauge", _T, "episodes of the task leased now"),
    "rollcall_task_max_staleness_versions": Spec("gauge", _T, "the task's staleness bound"),
    "rollcall_task_trained_samples_total": Spec("counter", _T, "samples trained"),
    "rollcall_task_trained_groups_total": Spec("counter", _T, "groups trained"),
    "rollcall_task_reward": Spec("gauge", _T, "mean reward of the task's samples, last step"),
    "rollcall_task_expired_groups_total": Spec(
        "counter", _T, "finished groups expired (staleness)"
    ),
    "rollcall_task_quarantined_episodes_total": Spec("counter", _T, "episodes quarantined"),
    "rollcall_task_fenced_rejections_total": Spec(
        "counter", _T, "writes refused: the lease moved on"
    ),
    "rollcall_task_requeued_leases_total": Spec("counter", _T, "leases requeued"),
    # buffer and staleness
    "rollcall_buffer_episodes": Spec(
        "gauge", (JOB, "task", "status"), "episodes by state (done split: ready/claimed/consumed)"
    ),
    "rollcall_staleness_versions": Spec(
        "histogram", _T, "trained groups' staleness (consuming step - oldest turn's version)"
    ),
    "rollcall_buffer_ready_staleness_versions": Spec(
        "gauge", _T, "versions behind the policy of the oldest group waiting for the trainer"
    ),
    "rollcall_buffer_ready_age_seconds": Spec(
        "gauge", _T, "seconds since the oldest group waiting for the trainer finished"
    ),
    # workers (latest incarnation of every slot)
    "rollcall_node_up": Spec("gauge", _N, "1 while the worker is alive"),
    "rollcall_node_heartbeat_age_seconds": Spec("gauge", _N, "seconds since its last heartbeat"),
    "rollcall_node_progress_age_seconds": Spec(
        "gauge", _R, "rollout node: seconds since it last generated a token"
    ),
    "rollcall_node_restarts_total": Spec("counter", _N, "restarts of the slot (incarnations - 1)"),
    "rollcall_node_loaded_version": Spec("gauge", _R, "policy version the rollout node serves"),
    "rollcall_node_version_lag_versions": Spec(
        "gauge", _R, "policy version minus the version the rollout node serves"
    ),
    "rollcall_node_tokens_generated_total": Spec(
        "counter", _R, "tokens generated by the current incarnation"
    ),
    "rollcall_weight_load_seconds": Spec(
        "summary", _R, "rollout node weight loads (current incarnation)"
    ),
    "rollcall_weight_load_last_seconds": Spec("gauge", _R, "the node's last weight load"),
    # rollout slots as the supervisor sees them (waiting_capacity: no machine has room)
    "rollcall_rollout_slots": Spec("gauge", (JOB, "state"), "rollout node slots, by state"),
    "rollcall_node_machine_losses_total": Spec(
        "counter", _R, "rollout slot: machine losses (not counted against its restart budget)"
    ),
    # audit log
    "rollcall_events_total": Spec("counter", (JOB, "kind"), "events recorded, by kind"),
    "rollcall_drills_total": Spec("counter", (JOB, "drill", "result"), "drills run, passed/failed"),
    "rollcall_drill_lost_samples_total": Spec("counter", (JOB, "drill"), "samples drills lost"),
    "rollcall_drill_duplicated_samples_total": Spec(
        "counter", (JOB, "drill"), "samples drills found trained twice"
    ),
}

# written by ``collect`` itself (they describe the collection, so they are never stale)
COLLECTION = (
    "rollcall_database_up",
    "rollcall_collect_timestamp_seconds",
    "rollcall_collect_errors_total",
)
# counted by the driver's process, not read from the database (written by ``collect`` too)
PROCESS = ("rollcall_scheduler_missed_runs_total",)
# ``rollcall drill`` commands (the first word of a drill.completed event's ``drill``)
DRILLS = ("kill-rollout", "kill-trainer", "restart-db", "kill-node")

STEP_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
IO_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)


def sample_names(name: str) -> set[str]:
    """The sample names a family exports (what PromQL selects)."""
    kind = METRICS[name].kind
    if kind == "histogram":
        return {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    if kind == "summary":
        return {name, f"{name}_sum", f"{name}_count"}
    return {name}


def exported_sample_names() -> set[str]:
    return set().union(*(sample_names(n) for n in METRICS))


class _Histogram:
    """Bucket counts of values observed in this process (prometheus semantics: cumulative)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        for i, le in enumerate(self.buckets):
            if value <= le:
                self.counts[i] += times
        self.count += times
        self.sum += value * times

    def samples(self) -> list[tuple[str, float]]:
        cumulative: list[tuple[str, float]] = [
            (_le(le), float(n)) for le, n in zip(self.buckets, self.counts, strict=True)
        ]
        return [*cumulative, ("+Inf", float(self.count))]


def _le(v: float) -> str:
    return str(float(v))


def _family(name: str) -> Any:
    spec = METRICS[name]
    labels = list(spec.labels)
    if spec.kind == "gauge":
        return GaugeMetricFamily(name, spec.help, labels=labels)
    if spec.kind == "counter":
        return CounterMetricFamily(name, spec.help, labels=labels)
    if spec.kind == "histogram":
        return HistogramMetricFamily(name, spec.help, labels=labels)
    return SummaryMetricFamily(name, spec.help, labels=labels)


class MissedRuns:
    """The runs the control plane's scheduler dropped, by scheduler job id: APScheduler's
    ``EVENT_JOB_MISSED``, a run that would have started later than its ``misfire_grace_time``
    (APScheduler logs each one as "Run time of job ... was missed by ...")."""

    def __init__(self, scheduler: Any) -> None:
        from apscheduler.events import EVENT_JOB_MISSED

        self._scheduler = scheduler
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        scheduler.add_listener(self._missed, EVENT_JOB_MISSED)

    def _missed(self, event: Any) -> None:
        with self._lock:
            self._counts[str(event.job_id)] += 1

    def counts(self) -> dict[str, int]:
        """Every job of the scheduler (0 when none of its runs was missed), and every job
        that missed one."""
        try:
            ids = [job.id for job in self._scheduler.get_jobs()]
        except Exception:  # shut down
            ids = []
        with self._lock:
            return {**dict.fromkeys(ids, 0), **self._counts}


class MetricsExporter(Collector):
    def __init__(
        self,
        db: Database,
        job_id: int,
        job_name: str,
        *,
        checkpoint_every: int = 1,
        publish_every: int = 1,
        total_steps: int | None = None,
        node_actors: Callable[[], list[Any]] | None = None,
        missed_runs: MissedRuns | None = None,
    ) -> None:
        self.db = db
        self.missed_runs = missed_runs
        self.job_id = job_id
        self.job_name = job_name
        self.checkpoint_every = checkpoint_every
        self.publish_every = publish_every
        self.total_steps = total_steps
        self.node_actors = node_actors
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._families: list[Metric] = []
        self._database_up = 0.0
        self._collected_at = 0.0
        self._errors = 0
        self._step_s = _Histogram(STEP_BUCKETS_S)
        self._checkpoint_s = _Histogram(IO_BUCKETS_S)
        self._publish_s = _Histogram(IO_BUCKETS_S)
        self._seen_step: int | None = None  # steps up to this one are not observed
        self._reports: dict[int, dict[str, Any]] = {}  # worker id -> the node's last report
        self._pending: dict[str, Any] = {}  # actor id -> its report call in flight
        self.server: Any = None
        self.url: str | None = None
        self.registry.register(self)

    # -- collection ----------------------------------------------------------------------------

    def refresh(self) -> None:
        """Collect from the database (and the rollout nodes); never raises."""
        try:
            with self.db.transaction() as tx:
                if self._seen_step is None:
                    self._seen_step = tx.monitoring.last_step_number(self.job_id)
                snap = snapshot(tx, self.job_id)
                new_steps = tx.monitoring.steps_after(self.job_id, self._seen_step)
        except Exception as e:
            with self._lock:
                self._errors += 1
                if is_transient(e):
                    self._database_up = 0.0
            if not is_transient(e):
                log.exception("metrics collection failed")
            return
        self._read_node_reports()
        with self._lock:
            for s in new_steps:
                self._observe_step(s)
                self._seen_step = s.step
            self._families = self._build(snap)
            self._database_up = 1.0
            self._collected_at = time.time()

    def _observe_step(self, s: Any) -> None:
        m = s.metrics
        self._step_s.observe(step_seconds(s))
        last = self.total_steps is not None and s.step + 1 == self.total_steps
        if (s.step + 1) % self.checkpoint_every == 0 or last:
            self._checkpoint_s.observe(float(m.get("checkpoint_s", 0.0) or 0.0))
        if (s.step + 1) % self.publish_every == 0 or last:
            self._publish_s.observe(float(m.get("publish_s", 0.0) or 0.0))

    def take_reports(self, reports: list[dict[str, Any]]) -> None:
        """Reports the driver already fetched from the rollout nodes (after every step): the
        freshest a collection can have, also for a node that stops right after."""
        with self._lock:
            for report in reports:
                self._keep(report)

    def _keep(self, report: dict[str, Any]) -> None:
        """Keep a node's report unless the one kept is newer (by the node's ``report_seq``):
        a report asked for by a collection can be answered after the driver handed over a
        newer one. Call with the lock held."""
        wid = int(report["worker_id"])
        kept = self._reports.get(wid)
        if kept is None or report.get("report_seq", 0) >= kept.get("report_seq", 0):
            self._reports[wid] = report

    def _read_node_reports(self) -> None:
        """Collect the rollout nodes' reports that have arrived and ask again, never waiting:
        a node still starting, busy or hung answers later (or never, and its heartbeat age
        shows it). Reports are one collection behind."""
        if self.node_actors is None:
            return
        try:
            import ray

            actors = {a._actor_id.hex(): a for a in self.node_actors()}
            pending = {k: r for k, r in self._pending.items() if k in actors}
            if pending:
                ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=0)
                done = {ref.hex() for ref in ready}
                for key, ref in list(pending.items()):
                    if ref.hex() not in done:
                        continue
                    del pending[key]
                    try:
                        report = ray.get(ref, timeout=0)
                    except Exception:  # the node died: its heartbeat age shows it
                        continue
                    with self._lock:
                        self._keep(report)
            for key, actor in actors.items():
                if key not in pending:
                    pending[key] = actor.report.remote()
            self._pending = pending
        except Exception:
            log.debug("rollout node reports unavailable", exc_info=True)

    def _build(self, snap: JobSnapshot) -> list[Metric]:
        j = self.job_name
        f = {name: _family(name) for name in METRICS if name not in COLLECTION + PROCESS}
        p = snap.job
        f["rollcall_policy_version"].add_metric([j], p.policy_version)
        f["rollcall_weights_version"].add_metric([j], p.weights_version or 0)
        f["rollcall_train_steps_total"].add_metric([j], p.steps)
        if p.last_step_age_s is not None:
            f["rollcall_last_step_age_seconds"].add_metric([j], p.last_step_age_s)
        if snap.busy_ratio is not None:
            f["rollcall_trainer_busy_ratio"].add_metric([j], snap.busy_ratio)
        for name, h in (
            ("rollcall_trainer_step_seconds", self._step_s),
            ("rollcall_checkpoint_save_seconds", self._checkpoint_s),
            ("rollcall_weight_publish_seconds", self._publish_s),
        ):
            f[name].add_metric([j], buckets=h.samples(), sum_value=h.sum)
        f["rollcall_trainer_restarts_total"].add_metric(
            [j], snap.events.get("trainer.restarted", 0)
        )
        f["rollcall_trainer_start_failures_total"].add_metric(
            [j], snap.events.get("trainer.start_failed", 0)
        )
        # the latest step that has each (a step of stale samples only has no on-policy one)
        for name, stat, fn in (
            ("rollcall_is_weight_mean", "is_weight_mean", float),
            ("rollcall_is_weight_onpolicy_geomean", "is_log_weight_onpolicy_mean", math.exp),
        ):
            found = [
                float(v)
                for v in (s.metrics.get(stat) for s in snap.steps)
                if isinstance(v, int | float) and not isinstance(v, bool)
            ]
            if found:
                f[name].add_metric([j], fn(found[-1]))
        for t in snap.tasks:
            lt = [j, t.name]
            f["rollcall_task_weight"].add_metric(lt, t.weight)
            f["rollcall_task_quota_ratio"].add_metric(lt, t.quota_share)
            if t.mix_share is not None:
                f["rollcall_task_mix_ratio"].add_metric(lt, t.mix_share)
            f["rollcall_task_active"].add_metric(lt, 1.0 if t.status == "active" else 0.0)
            f["rollcall_task_max_inflight"].add_metric(lt, t.max_inflight)
            f["rollcall_task_inflight_episodes"].add_metric(lt, t.inflight)
            f["rollcall_task_max_staleness_versions"].add_metric(lt, t.max_staleness)
            f["rollcall_task_trained_samples_total"].add_metric(lt, t.samples["consumed"])
            f["rollcall_task_trained_groups_total"].add_metric(lt, t.episodes["consumed"])
            if t.reward is not None:
                f["rollcall_task_reward"].add_metric(lt, t.reward)
            for counter in ("expired_groups", "quarantined_episodes", "fenced_rejections"):
                f[f"rollcall_task_{counter}_total"].add_metric(lt, t.counters[counter])
            f["rollcall_task_requeued_leases_total"].add_metric(lt, t.counters["requeued_leases"])
            for state in EPISODE_STATES:
                f["rollcall_buffer_episodes"].add_metric([j, t.name, state], t.episodes[state])
            hist = _Histogram(STALENESS_BUCKETS)
            for lag, groups in t.trained_staleness.items():
                hist.observe(lag, groups)
            f["rollcall_staleness_versions"].add_metric(
                lt, buckets=hist.samples(), sum_value=hist.sum
            )
            f["rollcall_buffer_ready_staleness_versions"].add_metric(lt, t.ready_staleness)
            f["rollcall_buffer_ready_age_seconds"].add_metric(lt, t.ready_age_s)
        for n in snap.nodes:
            ln, lr = [j, n["name"], n["role"]], [j, n["name"]]
            f["rollcall_node_up"].add_metric(ln, 1.0 if n["status"] == "alive" else 0.0)
            f["rollcall_node_heartbeat_age_seconds"].add_metric(ln, n["heartbeat_age_s"])
            f["rollcall_node_restarts_total"].add_metric(ln, n["restarts"])
            if n["role"] != "rollout":
                continue
            f["rollcall_node_progress_age_seconds"].add_metric(lr, n["progress_age_s"])
            version = n["loaded_version"]
            if version is not None:
                f["rollcall_node_loaded_version"].add_metric(lr, version)
                f["rollcall_node_version_lag_versions"].add_metric(
                    lr, max(0, p.policy_version - version)
                )
            f["rollcall_node_tokens_generated_total"].add_metric(lr, n["tokens_generated"])
            report = self._reports.get(int(n["id"]))
            if report is not None:
                f["rollcall_weight_load_seconds"].add_metric(
                    lr, count_value=report["weight_loads"], sum_value=report["weight_load_s_total"]
                )
                f["rollcall_weight_load_last_seconds"].add_metric(lr, report["weight_load_s_last"])
        states = dict.fromkeys(SLOT_STATES, 0)  # every state has a series, at 0
        for slot in snap.slots:
            states[slot["state"]] = states.get(slot["state"], 0) + 1
            f["rollcall_node_machine_losses_total"].add_metric(
                [j, slot["name"]], slot["machine_losses"]
            )
        for state, count in states.items():
            f["rollcall_rollout_slots"].add_metric([j, state], count)
        for kind, count in sorted(snap.events.items()):
            f["rollcall_events_total"].add_metric([j, kind], count)
        # the built-in drills always have series (at 0), so that increase() sees the first one
        runs = {(d, r): 0 for d in DRILLS for r in ("passed", "failed")}
        lost = dict.fromkeys(DRILLS, 0)
        duplicated = dict.fromkeys(DRILLS, 0)
        for d in snap.drills:
            key = (d.drill, "passed" if d.passed else "failed")
            runs[key] = runs.get(key, 0) + d.count
            lost[d.drill] = lost.get(d.drill, 0) + d.lost
            duplicated[d.drill] = duplicated.get(d.drill, 0) + d.duplicated
        for (drill, result), count in sorted(runs.items()):
            f["rollcall_drills_total"].add_metric([j, drill, result], count)
        for drill in sorted(lost):
            f["rollcall_drill_lost_samples_total"].add_metric([j, drill], lost[drill])
            f["rollcall_drill_duplicated_samples_total"].add_metric([j, drill], duplicated[drill])
        return list(f.values())

    def describe(self) -> Iterable[Metric]:
        return [_family(name) for name in METRICS]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            families = list(self._families)
            up, at, errors = self._database_up, self._collected_at, self._errors
        j = self.job_name
        for name, value in zip(COLLECTION, (up, at, errors), strict=True):
            fam = _family(name)
            fam.add_metric([j], value)
            yield fam
        missed = _family("rollcall_scheduler_missed_runs_total")
        if self.missed_runs is not None:
            for job, count in sorted(self.missed_runs.counts().items()):
                missed.add_metric([j, job], count)
        yield missed
        yield from families

    # -- the endpoint -------------------------------------------------------------------------

    def serve(self, host: str, port: int) -> str:
        """Serve ``/metrics`` on ``host:port`` (0: a free port); returns the URL."""
        from prometheus_client import start_http_server

        try:
            self.server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise UserError(
                f"metrics.port {port} on {host} cannot be used ({e.strerror}); set metrics.port "
                "to a free port (0: any), or metrics.enabled: false"
            ) from None
        bound = self.server.server_port
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{bound}/metrics"
        return self.url

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def start_exporter(
    cfg: RollcallConfig,
    db: Database,
    job_id: int,
    *,
    scheduler: Any,
    node_actors: Callable[[], list[Any]] | None = None,
    missed_runs: MissedRuns | None = None,
    say: Callable[[str], None] = log.info,
) -> MetricsExporter | None:
    """The driver's exporter (None when ``metrics.enabled`` is false): collected once, served,
    then refreshed by a scheduler job; its URL is recorded as a ``metrics.serving`` event."""
    m = cfg.metrics
    if not m.enabled:
        return None
    exporter = MetricsExporter(
        db,
        job_id,
        cfg.job.name,
        checkpoint_every=cfg.trainer.checkpoint_every,
        publish_every=cfg.trainer.sync_every,
        total_steps=cfg.run.total_steps,
        node_actors=node_actors,
        missed_runs=missed_runs,
    )
    exporter.refresh()
    url = exporter.serve(m.host, m.port)
    scheduler.add_job(
        exporter.refresh,
        "interval",
        seconds=m.interval_s,
        id="metrics",
        max_instances=1,
        coalesce=True,
    )
    with db.transaction() as tx:
        tx.events.add(
            "metrics.serving",
            "driver",
            f"metrics served at {url}",
            job_id=job_id,
            payload={"url": url},
        )
    say(f"metrics: {url}")
    return exporter
