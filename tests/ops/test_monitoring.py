"""deploy/monitoring/: the alert rules and the Grafana dashboard, validated offline.

``promtool`` (Debian package ``prometheus``) checks the rules and runs their unit
tests; the dashboard's expressions are checked by the same parser (as recording
rules), and every metric any expression names must be one the worker exports.
"""

from __future__ import annotations

import importlib
import importlib.util
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
CHART_RULES = REPO / "deploy" / "helm" / "worker" / "files" / "alerts.rules.yml"
YAMLLINT_CONFIG = Path(__file__).with_name("yamllint.yaml")

# Metrics another module exports once it exists; their alert and panels are in
# place already, and the check below names them only if that module is absent.
LATER = {"worker.outbox.relay": {"worker_outbox_pending", "worker_outbox_parked",
                           "worker_outbox_oldest_pending_seconds"}}  # fmt: skip
ALERTS = {
    "WorkerDeadLettersGrowing": "15m",
    "WorkerPaused": "5m",
    "WorkerNotReady": "10m",
    "WorkerBrokerDisconnected": "5m",
    "WorkerInboxPurgeLagging": "30m",
    "WorkerClaimsStuck": "15m",
    "WorkerInboxMetricsStale": "5m",
    "WorkerOutboxBacklog": "15m",
    "WorkerTargetDown": "10m",
    "WorkerTargetsAbsent": "15m",
    "WorkerMigrationFailed": "1m",
    "WorkerStuckInInit": "15m",
    "WorkerCrashLooping": "10m",
}
# kube-state-metrics (v2) series the Kubernetes alerts read, and Prometheus's own `up`
KUBERNETES_SERIES = {
    "up",
    "kube_job_failed",
    "kube_pod_init_container_status_running",
    "kube_pod_init_container_status_waiting",
    "kube_pod_container_status_waiting_reason",
}
OPERATIONS = REPO / "docs" / "operations.md"
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
        "info": ("_info",),
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
    tested = set(re.findall(r'alertname="(\w+)", alertstate="firing",\s', RULE_TESTS.read_text()))
    assert tested == set(ALERTS)  # every alert has a test in which it fires


def test_the_alert_tests_fail_against_a_rule_that_never_fires(tmp_path: Path) -> None:
    """promtool is awake: the same tests against rules that never fire report failures."""
    spec = yaml.safe_load(RULES.read_text())
    for group in spec["groups"]:
        for rule in group["rules"]:
            rule["expr"] = "vector(0) > 1"
    (tmp_path / RULES.name).write_text(yaml.safe_dump(spec))
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    tool = require_command("promtool", "apt-get install prometheus (it ships promtool)")
    result = subprocess.run(
        [tool, "test", "rules", RULE_TESTS.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    for name in ALERTS:
        assert f'alertname=\\"{name}\\"' in result.stdout + result.stderr, name


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return found


def test_every_rule_links_its_runbook_section_in_the_operations_guide() -> None:
    sections = anchors(OPERATIONS.read_text())
    for rule in rules():
        url = rule["annotations"]["runbook_url"]
        path, _, anchor = url.partition("#")
        assert path == "docs/operations.md", rule["alert"]
        assert anchor == rule["alert"].lower() and anchor in sections, rule["alert"]


def test_the_kubernetes_alerts_read_kube_state_metrics_series_that_exist() -> None:
    named = set()
    for rule in rules():
        named |= set(re.findall(r"\b(kube_[a-z_]+|up)\{", rule["expr"]))
    assert named == KUBERNETES_SERIES


def test_the_operator_objects_carry_the_rules_unchanged() -> None:
    loader = importlib.util.spec_from_file_location("sync_rules", MONITORING / "sync_rules.py")
    assert loader is not None and loader.loader is not None
    sync = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(sync)
    source = RULES.read_text()
    component = sync.COMPONENT.read_text()
    assert component == sync.component_text(source), "run deploy/monitoring/sync_rules.py"
    assert sync.CHART_COPY.read_text() == source, "run deploy/monitoring/sync_rules.py"
    rule = yaml.safe_load(component)
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == yaml.safe_load(source)["groups"]


def test_the_alerts_and_their_durations_are_the_documented_ones() -> None:
    assert {rule["alert"]: rule["for"] for rule in rules()} == ALERTS
    assert all(rule["labels"]["severity"] in ("warning", "critical") for rule in rules())
    documented = (REPO / "docs" / "operations.md").read_text()
    assert all(name in documented for name in ALERTS)


def test_promtool_parses_every_dashboard_expression(tmp_path: Path) -> None:
    recording = [
        {"record": f"dashboard:expr_{i}", "expr": grafana_free(expr)}
        for i, expr in enumerate(dashboard_expressions())
    ]
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": recording}]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def grafana_free(expression: str) -> str:
    """A dashboard expression as Prometheus sees it once Grafana has filled in its variables."""
    for variable in ("$namespace", "$job", "$pod"):
        expression = expression.replace(variable, ".*")
    return expression.replace("$__rate_interval", "5m")


def test_every_dashboard_query_is_scoped_to_the_chosen_namespace_job_and_pod() -> None:
    spec = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in spec["templating"]["list"]}
    assert {"datasource", "namespace", "job", "pod"} <= set(variables)
    for name in ("namespace", "job", "pod"):
        assert variables[name]["query"]["query"].startswith("label_values(worker_build_info")
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    scope = 'namespace=~"$namespace", job=~"$job", pod=~"$pod"'
    for expression in dashboard_expressions():
        for match in re.finditer(r"\b(worker_[a-z0-9_]+)(\{[^}]*\})?", expression):
            assert match.group(2) and scope in match.group(2), expression


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
        "worker_broker_events_total",  # reconnects, lost settlements, rebalances
        "worker_conflict_resolutions_total",
        "worker_build_info",  # which versions run
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
        [
            tool,
            "-c",
            str(YAMLLINT_CONFIG),
            "-f",
            "parsable",
            *map(str, (RULES, RULE_TESTS, CHART_RULES)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout
