"""The deployment files and the code agree: variable names, values, probe paths, ports, grace.

A misspelled ``WORKER_`` variable is silently ignored by pydantic-settings (the
worker runs with the default), so every variable that compose, the manifests,
the Secret template or the image set must be a field of ``worker.settings.Settings``
or of an adapter's ``*Settings`` class, and every value must pass its validation.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.ops.deploy_helpers import (
    COMPOSE,
    OVERLAYS,
    compose,
    compose_workers,
    config,
    dockerfile_env,
    dockerfile_instructions,
    emulator_config,
    known_variables,
    one,
    render,
    secret_template,
    secret_templates,
    settings_classes,
    stages,
)
from worker.ops import HEALTHZ, METRICS, READYZ
from worker.settings import Settings, load

WORKER_VARIABLE = re.compile(r"\bWORKER_[A-Z0-9_]+\b")


def unknown(names: set[str]) -> set[str]:
    return {name for name in names if name.upper() not in known_variables()}


def manifest_variables(overlay: str) -> set[str]:
    names = set(config(overlay))
    for doc in render(overlay):
        for match in WORKER_VARIABLE.finditer(yaml.safe_dump(doc)):
            names.add(match.group())
    return names


def pod_spec(overlay: str, kind: str = "Deployment") -> dict[str, Any]:
    spec: dict[str, Any] = one(render(overlay), kind)["spec"]["template"]["spec"]
    return spec


def deployment_env(overlay: str) -> dict[str, str]:
    """The environment a worker pod starts with: ConfigMap plus the Secret template."""
    return {**config(overlay), **secret_template()}


def test_the_checker_flags_a_misspelled_variable() -> None:
    assert "WORKER_CONCURRENCY" in known_variables()
    assert "WORKER_RABBITMQ_QUEUE" in known_variables()
    assert unknown({"WORKER_CONCURENCY", "WORKER_OPS_PORT"}) == {"WORKER_CONCURENCY"}


def test_every_adapter_settings_class_is_collected() -> None:
    prefixes = {str(cls.model_config.get("env_prefix")) for cls in settings_classes()}
    assert {"WORKER_", "WORKER_RABBITMQ_", "WORKER_KAFKA_", "WORKER_SERVICEBUS_"} <= prefixes


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifest_variables_exist_and_their_values_load(
    overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert unknown(manifest_variables(overlay)) == set()
    assert config(overlay)["WORKER_BROKER"] == overlay
    for name in list(os.environ):
        if name.startswith("WORKER_"):
            monkeypatch.delenv(name)
    for name, value in deployment_env(overlay).items():
        monkeypatch.setenv(name, value)
    for cls in settings_classes():  # a bad value fails here as it would at pod start
        load(cls)


def test_secret_template_and_image_variables_exist() -> None:
    assert unknown(set(secret_template())) == set()
    image = {n for n in dockerfile_env(dockerfile_instructions()) if n.startswith("WORKER_")}
    assert image  # WORKER_OPS_PORT and WORKER_LOG_FORMAT
    assert unknown(image) == set()


def test_compose_variables_exist_and_their_values_load(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, service in compose_workers().items():
        env = service["environment"]
        assert unknown(set(env)) == set(), name
        with monkeypatch.context() as patch:
            for variable, value in env.items():
                patch.setenv(variable, str(value))
            for cls in settings_classes():
                load(cls)
    assert unknown(set(WORKER_VARIABLE.findall(COMPOSE.read_text()))) == set()


# -- probes and ports --------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_hit_the_worker_s_own_paths_and_port(overlay: str) -> None:
    port = int(config(overlay)["WORKER_OPS_PORT"])
    spec = pod_spec(overlay)
    [container] = spec["containers"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}

    def target(probe: str) -> tuple[str, int]:
        http = container[probe]["httpGet"]
        resolved = named.get(http["port"], http["port"])
        return http["path"], resolved

    assert target("livenessProbe") == (HEALTHZ, port)
    assert target("startupProbe") == (HEALTHZ, port)
    assert target("readinessProbe") == (READYZ, port)
    annotations = one(render(overlay), "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] == METRICS
    assert int(annotations["prometheus.io/port"]) == port
    service = one(render(overlay), "Service")
    assert [named[p["targetPort"]] for p in service["spec"]["ports"]] == [port]


def test_compose_and_image_healthchecks_hit_the_worker_s_own_path_and_port() -> None:
    for name, service in compose_workers().items():
        port = service["environment"]["WORKER_OPS_PORT"]
        check = " ".join(service["healthcheck"]["test"])
        assert f"127.0.0.1:{port}{HEALTHZ}" in check, name
    final = stages(dockerfile_instructions())[-1]
    env = dockerfile_env(final)
    healthcheck = dict(final)["HEALTHCHECK"]
    assert HEALTHZ in healthcheck
    assert "WORKER_OPS_PORT" in healthcheck
    assert env["WORKER_OPS_PORT"] == dict(final)["EXPOSE"]


# -- shutdown ----------------------------------------------------------------------


# After WORKER_GRACE_PERIOD the worker still gives back what it prefetched, closes the
# broker connection, stops the ops endpoint (up to 5 s), disposes the pool and flushes
# traces: deploy/README.md, "Stopping", budgets 30 s for that.
SHUTDOWN_AFTER_GRACE = 30


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_waits_longer_than_the_worker_s_grace_period(overlay: str) -> None:
    grace = float(config(overlay).get("WORKER_GRACE_PERIOD", Settings().grace_period))
    termination = pod_spec(overlay)["terminationGracePeriodSeconds"]
    assert termination >= grace + SHUTDOWN_AFTER_GRACE
    assert one(render(overlay), "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    strategy = one(render(overlay), "Deployment")["spec"]["strategy"]["rollingUpdate"]
    if overlay == "kafka":  # no surge pod: it could find no partition (test_deploy_manifests)
        assert strategy == {"maxSurge": 0, "maxUnavailable": 1}
    else:
        assert strategy["maxUnavailable"] == 0  # a rollout never drops below the replicas


def test_compose_waits_longer_than_the_worker_s_grace_period() -> None:
    for name, service in compose_workers().items():
        grace = float(service["environment"].get("WORKER_GRACE_PERIOD", Settings().grace_period))
        stop = service["stop_grace_period"]
        assert stop.endswith("s")
        assert float(stop[:-1]) > grace, name


# -- security --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Deployment", "Job"])
def test_pods_run_as_the_image_s_non_root_user_read_only_unprivileged(kind: str) -> None:
    uid = int(dict(stages(dockerfile_instructions())[-1])["USER"].split(":")[0])
    spec = pod_spec("rabbitmq", kind)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == uid
    assert spec["automountServiceAccountToken"] is False
    for container in [*spec.get("initContainers", []), *spec["containers"]]:
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
        assert container["resources"]["requests"] and container["resources"]["limits"]
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/tmp" in mounts  # the only writable path


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_allow_only_dns_the_database_and_the_broker(overlay: str) -> None:
    policies = [doc for doc in render(overlay) if doc["kind"] == "NetworkPolicy"]
    egress_ports: set[int | str] = set()
    for policy in policies:
        assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "worker"
        for rule in policy["spec"].get("egress", []):
            egress_ports.update(port["port"] for port in rule["ports"])
    base = one(render(overlay), "NetworkPolicy", "worker")
    assert set(base["spec"]["policyTypes"]) == {"Ingress", "Egress"}  # default deny both ways
    database_port = urlsplit(secret_template()["WORKER_DATABASE_URL"]).port
    broker_port = {
        "rabbitmq": urlsplit(secret_template()["WORKER_RABBITMQ_URL"]).port,
        "kafka": int(config("kafka")["WORKER_KAFKA_BOOTSTRAP_SERVERS"].rsplit(":", 1)[1]),
        "servicebus": 5671,  # AMQP over TLS
    }[overlay]
    broker_ports = {"rabbitmq": {5672, 5671}, "kafka": {9092, 9093}, "servicebus": {5671, 443}}
    assert broker_port in broker_ports[overlay]
    # DNS (and OpenShift's 5353), the database, OTLP, HTTPS out, the broker: nothing else
    assert egress_ports == {53, 5353, database_port, 4317, 4318, 443} | broker_ports[overlay]


# -- autoscaling -------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_scaled_objects_scale_this_deployment_on_this_worker_s_queue(overlay: str) -> None:
    docs = render(overlay)
    scaled = one(docs, "ScaledObject")["spec"]
    assert scaled["scaleTargetRef"]["name"] == one(docs, "Deployment")["metadata"]["name"]
    assert 2 <= scaled["minReplicaCount"] <= scaled["maxReplicaCount"]
    [trigger] = scaled["triggers"]
    metadata, env = trigger["metadata"], config(overlay)
    if overlay == "rabbitmq":
        assert trigger["type"] == "rabbitmq"
        assert metadata["queueName"] == env["WORKER_RABBITMQ_QUEUE"]
    elif overlay == "kafka":
        assert trigger["type"] == "kafka"
        assert metadata["consumerGroup"] == env["WORKER_KAFKA_GROUP_ID"]
        assert metadata["topic"] in env["WORKER_KAFKA_TOPICS"].split(",")
        assert metadata["bootstrapServers"] == env["WORKER_KAFKA_BOOTSTRAP_SERVERS"]
        assert metadata["offsetResetPolicy"] == env["WORKER_KAFKA_AUTO_OFFSET_RESET"]
    else:
        assert trigger["type"] == "azure-servicebus"
        assert metadata["queueName"] == env["WORKER_SERVICEBUS_QUEUE"]
    reference = trigger.get("authenticationRef")
    if reference is not None:
        auth = one(docs, "TriggerAuthentication", reference["name"])
        secret_refs = {
            source["secretRef"]["name"]
            for source in pod_spec(overlay)["containers"][0]["envFrom"]
            if "secretRef" in source
        }
        for ref in auth["spec"]["secretTargetRef"]:
            assert ref["key"] in secret_templates()[ref["name"]]  # the template lists it
            if overlay == "servicebus":
                # KEDA needs Manage rights to read the count; the worker must not have them
                assert ref["name"] not in secret_refs
            else:  # RabbitMQ: the same broker address the worker uses
                assert ref["name"] in secret_refs


def test_compose_service_bus_worker_matches_the_emulator_config() -> None:
    env = compose()["services"]["worker-servicebus"]["environment"]
    [namespace] = emulator_config()["UserConfig"]["Namespaces"]
    queues = {queue["Name"]: queue["Properties"] for queue in namespace["Queues"]}
    queue = queues[env["WORKER_SERVICEBUS_QUEUE"]]
    assert int(env["WORKER_SERVICEBUS_ENTITY_MAX_DELIVERY_COUNT"]) == queue["MaxDeliveryCount"]
    assert (
        int(env.get("WORKER_MAX_DELIVERIES", Settings().max_deliveries)) < queue["MaxDeliveryCount"]
    )  # the worker dead-letters, with its reason, before the emulator does
    assert "UseDevelopmentEmulator=true" in env["WORKER_SERVICEBUS_CONNECTION_STRING"]
    assert "sb://servicebus;" in env["WORKER_SERVICEBUS_CONNECTION_STRING"]  # the service name
