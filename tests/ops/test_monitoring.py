"""deploy/monitoring/: the alert rules and the Grafana dashboard, validated offline.

``promtool`` (Debian package ``prometheus``) checks the rules and runs their unit
tests; the dashboard's expressions are checked by the same parser (as recording
rules), and every metric any expression names must be one the worker exports.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import REGISTRY

from tests.support.processes import REPO
from tests.support.services import require_command

MONITORING = REPO / "deploy" / "monitoring"
RULES = MONITORING / "alerts.rules.yml"
RULE_TESTS = MONITORING / "alerts.test.yml"
DASHBOARD = MONITORING / "dashboard.json"
YAMLLINT_CONFIG = Path(__file__).with_name("yamllint.yaml")

# Metrics another module exports once it exists; their alert and panels are in
# place already, and the check below names them only if that module is absent.
LATER = {"worker.outbox.relay": {"worker_outbox_pending", "worker_outbox_parked",
                           "worker_outbox_oldest_pending_seconds"}}  # fmt: skip
ALERTS = {
    "WorkerDeadLettersGrowing": "10m",
    "WorkerPaused": "5m",
    "WorkerNotReady": "10m",
    "WorkerBrokerDisconnected": "5m",
    "WorkerInboxPurgeLagging": "30m",
    "WorkerClaimsStuck": "15m",
    "WorkerInboxMetricsStale": "5m",
    "WorkerOutboxBacklog": "15m",
}
_METRIC = re.compile(r"\b(worker_[a-z0-9_]+)\b")
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "or"}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    tool = require_command("promtool", "apt-get install prometheus (it ships promtool)")
    return subprocess.run(
        [tool, *args], cwd=MONITORING, capture_output=True, text=True, timeout=60, check=False
    )


def rules() -> list[dict[str, Any]]:
    spec = yaml.safe_load(RULES.read_text())
    return [rule for group in spec["groups"] for rule in group["rules"]]


def dashboard_expressions() -> list[str]:
    spec = json.loads(DASHBOARD.read_text())
    return [
        target["expr"]
        for panel in spec["panels"]
        for target in panel.get("targets", [])
        if target.get("expr")
    ]


def exported_names() -> set[str]:
    """Every sample name the worker's collectors and metrics can put on /metrics."""
    for module in ("worker.metrics", "worker.ops", *LATER):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:
            continue
    names: set[str] = set()
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("_sum", "_count", "_created"),
        "gauge": ("",),
    }
    for family in REGISTRY.collect():
        names.add(family.name)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
    return names


def named_metrics(expression: str) -> set[str]:
    return set(_METRIC.findall(expression)) - _PROMQL_WORDS


def test_promtool_accepts_the_alert_rules() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


def test_each_alert_is_quiet_before_its_threshold_and_fires_after_it() -> None:
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    tested = set(re.findall(r'alertname="(\w+)"', RULE_TESTS.read_text()))
    assert tested >= set(ALERTS) - {"WorkerBrokerDisconnected", "WorkerInboxMetricsStale"}


def test_the_alerts_and_their_durations_are_the_documented_ones() -> None:
    assert {rule["alert"]: rule["for"] for rule in rules()} == ALERTS
    assert all(rule["labels"]["severity"] in ("warning", "critical") for rule in rules())
    documented = (REPO / "docs" / "operations.md").read_text()
    assert all(name in documented for name in ALERTS)


def test_promtool_parses_every_dashboard_expression(tmp_path: Path) -> None:
    recording = [
        {"record": f"dashboard:expr_{i}", "expr": expr.replace("$__rate_interval", "5m")}
        for i, expr in enumerate(dashboard_expressions())
    ]
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": recording}]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_expression_names_a_metric_the_worker_exports() -> None:
    exported = exported_names()
    assert "worker_deliveries_total" in exported and "worker_inbox_purge_lag_seconds" in exported
    later = {name for module, names in LATER.items() for name in names}
    missing = []
    for expression in [*dashboard_expressions(), *(rule["expr"] for rule in rules())]:
        for name in sorted(named_metrics(expression) - exported - later):
            missing.append(f"{name} in {expression!r}")
    assert missing == []


def test_the_dashboard_shows_what_operators_asked_for() -> None:
    spec = json.loads(DASHBOARD.read_text())
    assert spec["uid"] == "idempotent-worker" and spec["schemaVersion"] >= 36
    every = " ".join(dashboard_expressions())
    for metric in (
        "worker_deliveries_total",  # throughput by outcome
        "worker_duplicates_total",
        "worker_in_flight",
        "worker_handler_duration_seconds_bucket",  # latency percentiles
        "worker_database_available",  # pauses
        "worker_broker_connected",
        "worker_inbox_markers",
        "worker_inbox_purge_lag_seconds",
        "worker_inbox_leases_expired",
        "worker_dead_letters_total",
        "worker_outbox_pending",
    ):
        assert metric in every, metric
    ids = [panel["id"] for panel in spec["panels"]]
    assert len(ids) == len(set(ids))
    for panel in spec["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]


def test_the_monitoring_yaml_passes_yamllint() -> None:
    tool = require_command("yamllint", "pip install -e '.[test]'")
    result = subprocess.run(
        [tool, "-c", str(YAMLLINT_CONFIG), "-f", "parsable", str(RULES), str(RULE_TESTS)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout
