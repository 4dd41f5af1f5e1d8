"""deploy/helm/worker: the chart, rendered and linted by Helm's own engine, then validated.

helm-python-sdk (a test dependency) binds Helm v4's Go SDK: ``Chart.render`` is what
``helm template`` runs, ``lint`` is ``helm lint``, and the values are checked against
values.schema.json as ``helm install`` checks them. Every rendered object then goes
through the same validators as the kustomize overlays (kubernetes-validate, strict, and
the CRD schemas of deploy/schemas/).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from tests.ops.deploy_helpers import (
    CHART,
    K8S_VERSION,
    REPO,
    connections_per_pod,
    helm,
    helm_failure,
    helm_render,
    one,
)
from tests.ops.test_ops_manifests import problems

BROKERS = ("rabbitmq", "kafka", "servicebus")


def values(broker: str = "rabbitmq", **extra: Any) -> dict[str, Any]:
    chosen: dict[str, Any] = {"broker": broker, "secrets": {"existingSecret": "billing-secrets"}}
    if broker == "servicebus":
        chosen["servicebus"] = {"keda": {"connectionSecret": "billing-keda-servicebus"}}
    chosen.update(extra)
    return chosen


def everything_on(broker: str) -> dict[str, Any]:
    chosen = values(
        broker,
        metrics={
            "podMonitor": {"enabled": True},
            "serviceMonitor": {"enabled": True},
            "prometheusRule": {"enabled": True, "runbookBaseUrl": "https://wiki.example/w/"},
        },
        priorityClassName="workers",
        imagePullSecrets=[{"name": "registry"}],
        tolerations=[{"key": "workers", "operator": "Exists", "effect": "NoSchedule"}],
        affinity={
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["w"]}]}
                    ]
                }
            }
        },
    )
    if broker == "kafka":  # SASL/TLS: KEDA reads its own Secret
        chosen["kafka"] = {"keda": {"authSecret": "billing-keda-kafka"}}
    return chosen


def pods(docs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """The pod templates of the Deployment and the migration Job."""
    return [doc["spec"]["template"] for doc in docs if doc["kind"] in ("Deployment", "Job")]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def selectors(docs: tuple[dict[str, Any], ...]) -> list[tuple[str, dict[str, str]]]:
    """Every label selector the release uses to find its own pods."""
    found = []
    for doc in docs:
        spec, kind = doc.get("spec", {}), doc["kind"]
        if kind in ("Deployment", "PodDisruptionBudget", "PodMonitor"):
            found.append((kind, spec["selector"]["matchLabels"]))
        elif kind == "Service":
            found.append((kind, spec["selector"]))
        elif kind == "NetworkPolicy":
            found.append((kind, spec["podSelector"]["matchLabels"]))
        if kind == "Deployment":
            for constraint in spec["template"]["spec"]["topologySpreadConstraints"]:
                found.append(("topologySpread", constraint["labelSelector"]["matchLabels"]))
    return found


# -- helm lint, the schema, every object valid ---------------------------------------


def test_helm_lint_finds_nothing_and_is_awake() -> None:
    report = helm().lint(str(CHART), values(), strict=True, kube_version=f"v{K8S_VERSION}")
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report
    typo = values()
    typo["autoscaling"] = {"maxReplica": 3}
    report = helm().lint(str(CHART), typo, strict=True)
    assert any("maxReplica" in error for error in report["errors"]), report


@pytest.mark.parametrize("broker", BROKERS)
def test_every_rendered_object_validates(broker: str) -> None:
    docs = helm_render(everything_on(broker))
    kinds = sorted(doc["kind"] for doc in docs)
    for kind in (
        "ConfigMap",
        "Deployment",
        "Job",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "PodMonitor",
        "PrometheusRule",
        "ScaledObject",
        "Service",
        "ServiceAccount",
        "ServiceMonitor",
        "TriggerAuthentication",
    ):
        assert kind in kinds, f"{broker}: no {kind}"
    for doc in docs:
        assert problems(doc) == [], f"{broker}: {doc['kind']}/{doc['metadata']['name']}"


def test_the_schema_refuses_a_misspelled_or_mistyped_value() -> None:
    with helm().Chart.load(str(CHART)) as chart:
        chart.validate_schema(values())
        for wrong in (
            {**values(), "brokr": "kafka"},
            {**values(), "broker": "sqs"},
            {**values(), "config": {"WORKER_CONCURRENCY": 8}},  # a number, not a string
            {**values(), "image": {"repository": "r", "digest": "sha256:short"}},
        ):
            with pytest.raises(helm().HelmError):
                chart.validate_schema(wrong)


# -- release-based names, two installs in one namespace ------------------------------


def test_names_and_labels_follow_the_release() -> None:
    docs = helm_render(values(), release="billing")
    deployment = one(docs, "Deployment")
    assert deployment["metadata"]["name"] == "billing-worker"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/instance"] == "billing"
    assert labels["app.kubernetes.io/version"] == "0.1.0"
    assert labels["app.kubernetes.io/name"] == "worker"
    scaled = one(docs, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "billing-worker"
    [trigger] = scaled["spec"]["triggers"]
    auth = one(docs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    assert auth["metadata"]["name"].startswith("billing-worker")
    job = one(docs, "Job")
    assert job["metadata"]["name"] == "billing-worker-migrate"
    assert "-migrate" in job["metadata"]["name"] and "worker" in job["metadata"]["name"]
    config = one(docs, "ConfigMap")["metadata"]["name"]
    for container in deployment["spec"]["template"]["spec"]["containers"]:
        assert {"configMapRef": {"name": config}} in container["envFrom"]
    # a release named after the chart keeps its name (no worker-worker)
    assert one(helm_render(values(), release="worker"), "Deployment")["metadata"]["name"] == (
        "worker"
    )


def test_two_installs_in_one_namespace_never_select_each_other() -> None:
    billing = helm_render(values(), release="billing", namespace="shared")
    refunds = helm_render(values("kafka"), release="refunds", namespace="shared")
    names = [(d["kind"], d["metadata"]["name"]) for d in (*billing, *refunds)]
    assert len(names) == len(set(names)), "an object name is shared by the two releases"
    for mine, theirs in ((billing, refunds), (refunds, billing)):
        for kind, selector in selectors(mine):
            consumers = [
                p for p in pods(mine) if p["metadata"]["labels"]["app.kubernetes.io/component"]
                == "consumer"
            ]  # fmt: skip
            assert any(selects(selector, p["metadata"]["labels"]) for p in consumers), kind
            for pod in pods(theirs):
                assert not selects(selector, pod["metadata"]["labels"]), (kind, selector)
    # the check can fail: without the instance label the selectors would overlap
    stripped = copy.deepcopy(billing)
    for doc in stripped:
        if doc["kind"] == "NetworkPolicy":
            del doc["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"]
    [(_, policy)] = [s for s in selectors(stripped) if s[0] == "NetworkPolicy"]
    assert any(selects(policy, pod["metadata"]["labels"]) for pod in pods(refunds))


# -- scaling: KEDA, or an HPA as the fallback -------------------------------------------


def test_without_keda_an_hpa_scales_the_same_deployment_within_the_same_bounds() -> None:
    keda = one(helm_render(values()), "ScaledObject")["spec"]
    docs = helm_render(values(autoscaling={"keda": {"enabled": False}}))
    assert not [doc for doc in docs if doc["apiVersion"].startswith("keda.sh/")]
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert problems(hpa) == []
    assert hpa["spec"]["scaleTargetRef"]["name"] == one(docs, "Deployment")["metadata"]["name"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (
        keda["minReplicaCount"],
        keda["maxReplicaCount"],
    )
    for doc in docs:
        if doc["kind"] == "Deployment":
            assert "replicas" not in doc["spec"]


@pytest.mark.parametrize("broker", BROKERS)
def test_the_keda_trigger_names_what_the_worker_consumes(broker: str) -> None:
    docs = helm_render(values(broker))
    env = one(docs, "ConfigMap")["data"]
    assert env["WORKER_BROKER"] == broker
    [trigger] = one(docs, "ScaledObject")["spec"]["triggers"]
    meta = trigger["metadata"]
    if broker == "rabbitmq":
        assert meta["queueName"] == env["WORKER_RABBITMQ_QUEUE"]
        auth = one(docs, "TriggerAuthentication")
        [ref] = auth["spec"]["secretTargetRef"]
        assert ref["name"] == "billing-secrets" and ref["key"] == "WORKER_RABBITMQ_URL"
    elif broker == "kafka":
        assert meta["consumerGroup"] == env["WORKER_KAFKA_GROUP_ID"]
        assert meta["topic"] in env["WORKER_KAFKA_TOPICS"].split(",")
        assert meta["bootstrapServers"] == env["WORKER_KAFKA_BOOTSTRAP_SERVERS"]
        strategy = one(docs, "Deployment")["spec"]["strategy"]["rollingUpdate"]
        assert strategy == {"maxSurge": 0, "maxUnavailable": 1}
    else:
        assert meta["queueName"] == env["WORKER_SERVICEBUS_QUEUE"]
        [ref] = one(docs, "TriggerAuthentication")["spec"]["secretTargetRef"]
        assert ref["name"] == "billing-keda-servicebus"  # KEDA's own, not the worker's


def test_kafka_replicas_beyond_the_partitions_are_refused() -> None:
    line = helm_failure(values("kafka", kafka={"partitions": 4}))
    assert "autoscaling.maxReplicas 6 > kafka.partitions 4" in line


# -- the migration hook, secrets ------------------------------------------------------------


def test_the_migration_runs_as_a_hook_before_install_and_upgrade() -> None:
    docs = helm_render(values())
    job = one(docs, "Job")
    annotations = job["metadata"]["annotations"]
    assert set(annotations["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
    assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation"
    spec = job["spec"]["template"]["spec"]
    # a pre-install hook runs before the release's ConfigMap and ServiceAccount exist
    assert "serviceAccountName" not in spec and spec["automountServiceAccountToken"] is False
    [migrate] = spec["containers"]
    assert "envFrom" not in migrate
    assert migrate["args"][0] == "migrate" and "--wait" not in migrate["args"]
    deployment = one(docs, "Deployment")["spec"]["template"]["spec"]
    [gate] = deployment["initContainers"]
    assert gate["args"][:2] == ["migrate", "--wait"] and gate["image"] == migrate["image"]


def test_the_migration_migrates_the_applications_the_pods_serve() -> None:
    """``worker migrate`` runs the histories of the applications WORKER_HANDLERS names: the
    hook (without the ConfigMap) must name the same ones as the pods, or the pods' gate would
    wait for tables the Job never created."""
    docs = helm_render(values(config={"WORKER_HANDLERS": "billing.handlers,shop.orders"}))
    [migrate] = one(docs, "Job")["spec"]["template"]["spec"]["containers"]
    [handlers] = [e for e in migrate["env"] if e["name"] == "WORKER_HANDLERS"]
    assert handlers["value"] == "billing.handlers,shop.orders"
    assert one(docs, "ConfigMap")["data"]["WORKER_HANDLERS"] == handlers["value"]


def test_the_migration_may_read_a_direct_database_url_for_pgbouncer_setups() -> None:
    docs = helm_render(values(secrets={"existingSecret": "s", "migrationDatabaseUrlKey": "DIRECT"}))
    [migrate] = one(docs, "Job")["spec"]["template"]["spec"]["containers"]
    [url] = [e for e in migrate["env"] if e["name"] == "WORKER_DATABASE_URL"]
    assert url["valueFrom"]["secretKeyRef"] == {"name": "s", "key": "DIRECT"}
    [worker] = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    [url] = [e for e in worker["env"] if e["name"] == "WORKER_DATABASE_URL"]
    assert url["valueFrom"]["secretKeyRef"]["key"] == "WORKER_DATABASE_URL"


def test_without_a_secret_the_render_fails_in_one_line_naming_the_values() -> None:
    line = helm_failure({})
    assert "secrets.existingSecret" in line and "secrets.externalSecret.enabled" in line
    line = helm_failure(values(config={"WORKER_DATABASE_URL": "postgresql+asyncpg://u:p@h/d"}))
    assert "WORKER_DATABASE_URL is a secret" in line


def test_the_secret_may_come_from_the_external_secrets_operator() -> None:
    docs = helm_render(
        {
            "secrets": {
                "externalSecret": {
                    "enabled": True,
                    "secretStoreRef": {"name": "vault"},
                    "data": [
                        {"secretKey": "WORKER_DATABASE_URL", "remoteRef": {"key": "billing/db"}}
                    ],
                }
            }
        }
    )
    external = one(docs, "ExternalSecret")
    assert problems(external) == []
    target = external["spec"]["target"]["name"]
    # created before the migration hook that needs it
    assert int(external["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
        one(docs, "Job")["metadata"]["annotations"]["helm.sh/hook-weight"]
    )
    for template in pods(docs):
        for container in [
            *template["spec"].get("initContainers", []),
            *template["spec"]["containers"],
        ]:
            [url] = [e for e in container["env"] if e["name"] == "WORKER_DATABASE_URL"]
            assert url["valueFrom"]["secretKeyRef"]["name"] == target
    broken = copy.deepcopy(external)
    del broken["spec"]["data"][0]["remoteRef"]
    assert problems(broken)  # the schema is awake


# -- placement and pod options ---------------------------------------------------------


def test_priority_pull_secrets_affinity_and_tolerations_reach_every_pod() -> None:
    docs = helm_render(everything_on("rabbitmq"))
    for template in pods(docs):
        spec = template["spec"]
        assert spec["priorityClassName"] == "workers"
        assert spec["imagePullSecrets"] == [{"name": "registry"}]
        assert spec["tolerations"][0]["key"] == "workers"
        assert "nodeAffinity" in spec["affinity"]


def test_an_image_digest_wins_over_the_tag() -> None:
    digest = "sha256:" + "ab" * 32
    docs = helm_render(values(image={"repository": "r.example/w", "tag": "1.2", "digest": digest}))
    images = {c["image"] for p in pods(docs) for c in [*p["spec"]["containers"]]}
    assert images == {f"r.example/w@{digest}"}


# -- the connection budget ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("broker", "config"),
    [
        ("rabbitmq", {}),
        ("kafka", {}),
        ("kafka", {"WORKER_KAFKA_OFFSETS": "database", "WORKER_DB_POOL_SIZE": "6"}),
        ("servicebus", {"WORKER_DB_POOL_SIZE": "6"}),
    ],
)
def test_the_chart_counts_the_same_connections_per_pod_as_the_formula(
    broker: str, config: dict[str, str]
) -> None:
    docs = helm_render(values(broker, config=config))
    env = one(docs, "ConfigMap")["data"]
    annotations = one(docs, "Deployment")["metadata"]["annotations"]
    counted = int(annotations["idempotent-worker/database-connections-per-pod"])
    assert counted == sum(connections_per_pod(env, broker).values())


def test_a_render_past_the_connection_budget_fails_and_says_what_to_change() -> None:
    # Kafka's pool at concurrency + 2 again, beside the offsets engine's 4: 6 x 16 + 3 > 90
    line = helm_failure(values("kafka", kafka={"config": {"WORKER_DB_POOL_SIZE": "10"}}))
    assert line.count("\n") == 0 or "connection budget" in line.splitlines()[0]
    assert "connection budget: 6 pods x 16 connections + 3 others = 99 > 90" in line
    assert "autoscaling.maxReplicas" in line


# -- the PrometheusRule ---------------------------------------------------------------------


def test_the_chart_ships_the_alert_rules_unchanged_but_for_the_runbook_base() -> None:
    source = yaml.safe_load((REPO / "deploy" / "monitoring" / "alerts.rules.yml").read_text())
    rule = one(helm_render(everything_on("rabbitmq")), "PrometheusRule")
    shipped = rule["spec"]["groups"]
    for group in shipped:
        for item in group["rules"]:
            url = item["annotations"]["runbook_url"]
            assert url.startswith("https://wiki.example/w/docs/operations.md#")
            item["annotations"]["runbook_url"] = url.removeprefix("https://wiki.example/w/")
    assert shipped == source["groups"]
