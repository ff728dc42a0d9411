"""The Grafana dashboard and the Prometheus alert rules in ``ops/`` against the exporter's
catalogue (``METRICS``; tests/integration/test_metrics.py shows the endpoint exports exactly
it): every expression parses (a real PromQL parser), every metric it selects is exported,
every label it matches, groups by, joins on or prints exists on what it reads. Every alert has
a severity, a summary and a runbook that exists and names it. The checker itself is shown to
reject a wrong name, a wrong label and a syntax error."""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path
from typing import Any

import promql_parser as pq
import pytest
import yaml

from rollcall.orchestrator.runner.metrics import METRICS, exported_sample_names

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "ops" / "grafana" / "rollcall.json"
ALERTS = ROOT / "ops" / "prometheus" / "alerts.yml"
RUNBOOKS = ROOT / "ops" / "runbooks"
# Grafana's range variables, replaced by a duration before parsing
GRAFANA_RANGES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
LABEL_REF = re.compile(r"\{\{\s*(?:\$labels\.)?(\w+)\s*\}\}")


def family_of(sample: str) -> str:
    if sample in METRICS:
        return sample
    base = re.sub(r"_(bucket|sum|count)$", "", sample)
    if base in METRICS and sample in exported_sample_names():
        return base
    raise AssertionError(f"{sample} is not a metric rollcall exports")


def sample_labels(sample: str) -> set[str]:
    labels = set(METRICS[family_of(sample)].labels)
    return labels | {"le"} if sample.endswith("_bucket") else labels


def check(expr: str) -> tuple[set[str], set[str]]:
    """Parse ``expr`` and check it against the catalogue; returns (metrics selected, labels of
    the result)."""
    for var, duration in GRAFANA_RANGES.items():
        expr = expr.replace(var, duration)
    names: set[str] = set()
    labels = _walk(pq.parse(expr), names)
    assert names, f"{expr!r} selects no metric"
    return names, labels


def _walk(node: Any, names: set[str]) -> set[str]:
    """The labels the node's result carries (an approximation that is exact for what the
    dashboards use); checks matchers, ``by``/``without`` and ``on``/``ignoring`` on the way."""
    if isinstance(node, pq.MatrixSelector):
        return _walk(node.vector_selector, names)
    if isinstance(node, pq.VectorSelector):
        assert node.name, "selectors must name their metric"
        family_of(node.name)
        names.add(node.name)
        have = sample_labels(node.name)
        for m in node.matchers.matchers:
            assert m.name in have, f"{node.name} has no label {m.name!r} (it has {sorted(have)})"
        return have
    if isinstance(node, pq.NumberLiteral | pq.StringLiteral):
        return set()
    if isinstance(node, pq.ParenExpr | pq.UnaryExpr | pq.SubqueryExpr):
        return _walk(node.expr, names)
    if isinstance(node, pq.Call):
        arg_labels = [_walk(a, names) for a in node.args]
        if node.func.name == "histogram_quantile":
            assert "le" in arg_labels[1], "histogram_quantile needs the le label"
            return arg_labels[1] - {"le"}
        return next((a for a in arg_labels if a), set())
    if isinstance(node, pq.AggregateExpr):
        inner = _walk(node.expr, names)
        if node.param is not None:
            _walk(node.param, names)
        mod = node.modifier
        if mod is None:
            return set()
        wanted = set(mod.labels)
        assert wanted <= inner, f"aggregation by {sorted(wanted - inner)}: not on {sorted(inner)}"
        return wanted if mod.type == pq.AggModifierType.By else inner - wanted
    if isinstance(node, pq.BinaryExpr):
        lhs, rhs = _walk(node.lhs, names), _walk(node.rhs, names)
        bmod = node.modifier
        matching = bmod.matching if bmod is not None else None
        if matching is not None and matching.labels:
            on = set(matching.labels)
            assert on <= lhs and on <= rhs, (
                f"matching on {sorted(on)}: {sorted(lhs)} / {sorted(rhs)}"
            )
        if str(node.op) in ("or", "TokenType.Lor"):
            return lhs | rhs
        return lhs or rhs
    raise AssertionError(f"unexpected PromQL node {type(node).__name__}")


def dashboard_targets() -> list[tuple[str, str, str]]:
    """(panel title, expression, legend) of every query in the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            out.append((panel["title"], t["expr"], t.get("legendFormat", "")))
    return out


def alert_rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(ALERTS.read_text())
    return [r for g in data["groups"] for r in g["rules"]]


def test_the_checker_rejects_wrong_names_labels_and_syntax() -> None:
    assert check('rate(rollcall_task_trained_samples_total{task="a"}[5m])')[0] == {
        "rollcall_task_trained_samples_total"
    }
    with pytest.raises(AssertionError, match="not a metric rollcall exports"):
        check("rollcall_task_trained_samples")  # the counter's name without _total
    with pytest.raises(AssertionError, match="not a metric rollcall exports"):
        check("up == 0")
    with pytest.raises(AssertionError, match="has no label 'node'"):
        check('rollcall_task_reward{node="x"}')
    with pytest.raises(AssertionError, match="aggregation by"):
        check("sum by (node) (rollcall_task_reward)")
    with pytest.raises(AssertionError, match="matching on"):
        check("rollcall_task_reward > on (node) rollcall_node_up")
    with pytest.raises(AssertionError, match="needs the le label"):
        check(
            "histogram_quantile(0.9, sum by (task) (rate(rollcall_staleness_versions_bucket[5m])))"
        )
    with pytest.raises(ValueError):
        check("sum(rate(rollcall_task_reward[5m])")


def test_dashboard_references_only_exported_metrics_and_labels() -> None:
    targets = dashboard_targets()
    assert len(targets) >= 30
    used: set[str] = set()
    for title, expr, legend in targets:
        names, labels = check(expr)
        used |= {family_of(n) for n in names}
        for ref in LABEL_REF.findall(legend):
            assert ref in labels, f"{title}: legend {{{{{ref}}}}} is not a label of {expr!r}"
        assert 'rollcall_job=~"$rollcall_job"' in expr, f"{title}: not filtered by job"
    # the job variable reads an exported metric's label
    dash = json.loads(DASHBOARD.read_text())
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            metric, label = re.fullmatch(
                r"label_values\((\w+), (\w+)\)", var["definition"]
            ).groups()  # type: ignore[union-attr]
            assert label in sample_labels(metric)
    # and the dashboard shows every family the endpoint exports
    assert used == set(METRICS), sorted(set(METRICS) - used)


def test_alert_rules_reference_exported_metrics_and_existing_runbooks() -> None:
    rules = alert_rules()
    assert len(rules) >= 10
    names = [r["alert"] for r in rules]
    assert len(set(names)) == len(names)
    runbooks_used = set()
    for r in rules:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r["alert"]
        assert re.fullmatch(r"Rollcall[A-Z]\w+", r["alert"])
        _, labels = check(r["expr"])
        assert r["labels"]["severity"] in ("critical", "warning", "info")
        if "for" in r:
            assert re.fullmatch(r"\d+[smh]", r["for"])
        ann = r["annotations"]
        for ref in LABEL_REF.findall(ann["summary"]):
            assert ref in labels, f"{r['alert']}: summary uses {ref!r}, not a label of its expr"
        runbook = ROOT / ann["runbook_url"]
        assert runbook.parent == RUNBOOKS and runbook.is_file(), ann["runbook_url"]
        assert r["alert"] in runbook.read_text(), f"{runbook.name} does not mention {r['alert']}"
        runbooks_used.add(runbook.name)
    # every runbook is reached by some alert
    assert runbooks_used == {p.name for p in RUNBOOKS.glob("*.md")} - {"README.md"}


def event_kinds() -> set[str]:
    """Event kinds written by rollcall (string literals like ``"worker.failed"`` in its source);
    they look like config keys (``trainer.failed``) and are not."""
    kinds: set[str] = set()
    for path in (ROOT / "orchestrator").rglob("*.py"):
        kinds |= set(
            re.findall(
                r'"((?:job|task|worker|trainer|episode|drill|db|metrics)\.[a-z_]+)"',
                path.read_text(),
            )
        )
    return kinds


def test_runbooks_name_real_metrics_commands_and_config_keys() -> None:
    """Every ``rollcall_*`` name in a runbook is exported; every ``rollcall ...`` command it
    shows exists; every dotted config key it names is a field of the config models."""
    from typer.main import get_command

    from rollcall.orchestrator.cli import app
    from rollcall.orchestrator.config import RollcallConfig

    cli = get_command(app)
    books = sorted(p for p in RUNBOOKS.glob("*.md") if p.name != "README.md")
    assert len(books) >= 6
    for book in books:
        text = book.read_text()
        metrics = set(re.findall(r"\brollcall_[a-z0-9_]+", text)) - {"rollcall_job"}
        assert metrics, f"{book.name} names no metric"
        for m in metrics:
            if not m.startswith(
                ("rollcall_attach", "rollcall_detach", "rollcall_migrator", "rollcall_runtime")
            ):
                family_of(m)
        commands = re.findall(r"`rollcall ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?", text)
        assert commands, f"{book.name} shows no command"
        for group, sub in commands:
            assert group in cli.commands, f"{book.name}: no command `rollcall {group}`"  # type: ignore[attr-defined]
            cmd = cli.commands[group]  # type: ignore[attr-defined]
            if sub and hasattr(cmd, "commands"):
                assert sub in cmd.commands, f"{book.name}: no command `rollcall {group} {sub}`"
        keys = re.findall(
            r"`((?:buffer|rollout|trainer|control_plane|metrics|run|ray)\.[a-z_.]+)", text
        )
        for key in set(keys) - event_kinds():
            models: list[Any] = [RollcallConfig]
            for part in key.split("."):
                # a union of models (rollout.engine: one per engine kind): any of them
                found = [
                    m.model_fields[part].annotation
                    for m in models
                    if part in getattr(m, "model_fields", {})
                ]
                assert found, f"{book.name}: no config key {key}"
                models = [a for f in found for a in (typing.get_args(f) or (f,))]


def test_manual_lists_every_metric() -> None:
    section = (ROOT / "docs" / "operations.md").read_text()
    listed = set(re.findall(r"`(rollcall_[a-z0-9_]+)`", section)) - {"rollcall_job"}
    # roles and SQL functions, not metrics
    listed -= {"rollcall_migrator", "rollcall_runtime", "rollcall_drop_old_events"}
    listed -= {"rollcall_compact_steps"}
    assert listed == set(METRICS), sorted(listed ^ set(METRICS))
