"""What no validator sees: the rendered manifests against the platform's own operations.

Each test reads the objects ``kubectl kustomize`` renders for every overlay (what
``kubectl apply -k`` would send) and checks one runtime property: KEDA alone owns
the replica count, node drains cannot hang on unready pods, no pod consumes before
its schema is migrated, the database connection budget holds at maximum scale, a
Kafka rollout can always finish, the credentials are separate where the rights
differ, and the NetworkPolicies neither open too much nor break DNS.
"""

from __future__ import annotations

import copy
import ipaddress
import os
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.ops.deploy_helpers import (
    COMPOSE,
    DEPLOY,
    OVERLAYS,
    REPO,
    compose,
    config,
    connections_per_pod,
    dockerfile_instructions,
    one,
    render,
    render_with,
    run,
    secret_template,
    secret_templates,
    stages,
    tool,
)

BUDGET = "idempotent-worker/database-"
PARTITIONS = "idempotent-worker/kafka-partitions"


def deployment(overlay: str) -> dict[str, Any]:
    return one(render(overlay), "Deployment")


def pod(overlay: str, kind: str = "Deployment") -> dict[str, Any]:
    spec: dict[str, Any] = one(render(overlay), kind)["spec"]["template"]["spec"]
    return spec


def scaled(overlay: str) -> dict[str, Any]:
    return one(render(overlay), "ScaledObject")


def every_container(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


# -- 4: KEDA owns the count -----------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_deployment_leaves_the_replica_count_to_keda(overlay: str) -> None:
    """A ``replicas:`` next to a ScaledObject resets the fleet on every ``apply -k``."""
    assert (
        scaled(overlay)["spec"]["scaleTargetRef"]["name"] == deployment(overlay)["metadata"]["name"]
    )
    assert "replicas" not in deployment(overlay)["spec"]


# -- 7: drains during an outage -------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_node_drains_may_evict_pods_that_are_unready_by_design(overlay: str) -> None:
    pdb = one(render(overlay), "PodDisruptionBudget")["spec"]
    assert pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    labels = deployment(overlay)["spec"]["template"]["metadata"]["labels"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()


# -- 1: the migration gate -------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_pod_consumes_before_its_schema_is_migrated(overlay: str) -> None:
    spec = pod(overlay)
    [worker] = spec["containers"]
    gates = [c for c in spec.get("initContainers", []) if c["args"][:1] == ["migrate"]]
    assert len(gates) == 1, "an init container must run `worker migrate --wait/--check`"
    [gate] = gates
    assert gate["args"][1] in {"--wait", "--check"}
    # the gate checks the head of the image that is about to run
    assert gate["image"] == worker["image"]
    job = pod(overlay, "Job")
    [migrate] = job["containers"]
    assert migrate["image"] == worker["image"]
    assert migrate["args"][0] == "migrate" and "--check" not in migrate["args"]
    # the gate waits less long than the rollout is allowed to take
    wait = float(gate["args"][gate["args"].index("--timeout") + 1])
    assert wait < deployment(overlay)["spec"]["progressDeadlineSeconds"]


def test_the_migration_job_can_be_recreated_per_release() -> None:
    """A Job's template is immutable: GitOps tools are told to replace it each release."""
    job = one(render("rabbitmq"), "Job")
    annotations = job["metadata"]["annotations"]
    assert annotations["argocd.argoproj.io/hook-delete-policy"] == "BeforeHookCreation"
    assert annotations["kustomize.toolkit.fluxcd.io/force"] == "Enabled"
    readme = (DEPLOY / "README.md").read_text()
    assert "kubectl delete job worker-migrate --ignore-not-found" in readme
    assert "are restarted; nothing is lost" not in readme  # the old, wrong promise


# -- 5: the database URL must exist ------------------------------------------------


@pytest.mark.parametrize("kind", ["Deployment", "Job"])
def test_every_pod_reads_the_database_url_from_a_required_secret_key(kind: str) -> None:
    for overlay in OVERLAYS:
        assert "WORKER_DATABASE_URL" not in config(overlay)
        for container in every_container(pod(overlay, kind)):
            env = {item["name"]: item for item in container.get("env", [])}
            reference = env["WORKER_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
            assert reference["name"] == "worker-secrets"
            assert reference["key"] == "WORKER_DATABASE_URL"
            assert reference.get("optional", False) is False, container["name"]


# -- 2: the connection budget -----------------------------------------------------


def connection_budget(overlay: str) -> tuple[int, int, dict[str, int]]:
    """(connections at maximum scale, connections available, the figures) of one overlay."""
    env = config(overlay)
    annotations = deployment(overlay)["metadata"]["annotations"]
    figures = {
        "max_replicas": int(scaled(overlay)["spec"]["maxReplicaCount"]),
        "max_surge": int(deployment(overlay)["spec"]["strategy"]["rollingUpdate"]["maxSurge"]),
        "per_pod": sum(connections_per_pod(env, env["WORKER_BROKER"]).values()),
        "others": int(annotations[BUDGET + "other-clients"]),
        "max_connections": int(annotations[BUDGET + "max-connections"]),
        "reserved": int(annotations[BUDGET + "reserved-connections"]),
    }
    # an init container's single connection ends before the worker opens its pool
    needed = (figures["max_replicas"] + figures["max_surge"]) * figures["per_pod"]
    needed += figures["others"]
    return needed, figures["max_connections"] - figures["reserved"], figures


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_connection_budget_holds_at_maximum_scale(overlay: str) -> None:
    """(maxReplicaCount + maxSurge) x per pod + others <= max_connections - reserved.

    Running out is not an error the pods can fix: 53300 pauses the running ones,
    crash-loops the new ones, and the growing backlog makes KEDA add more.
    """
    needed, available, figures = connection_budget(overlay)
    assert needed <= available, f"{overlay}: {figures} needs {needed} of {available}"
    fallback = scaled(overlay)["spec"]["fallback"]["replicas"]
    assert fallback <= figures["max_replicas"]


def test_the_budget_check_catches_the_old_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """20 replicas x 2 x (16 + 2) connections, as shipped before: far past 100."""
    rendered = copy.deepcopy(list(render("rabbitmq")))
    for doc in rendered:
        if doc["kind"] == "ScaledObject":
            doc["spec"]["maxReplicaCount"] = 20
        if doc["kind"] == "ConfigMap":
            doc["data"] = {k: v for k, v in doc["data"].items() if not k.startswith("WORKER_DB_")}
            doc["data"]["WORKER_CONCURRENCY"] = "16"
            doc["data"]["WORKER_DB_MAX_OVERFLOW"] = "18"  # the old default: = pool size
    import tests.ops.test_deploy_manifests as me

    monkeypatch.setattr(me, "render", lambda _overlay: tuple(rendered))
    monkeypatch.setattr(me, "config", lambda _overlay: one(tuple(rendered), "ConfigMap")["data"])
    needed, available, _ = connection_budget("rabbitmq")
    assert needed == 21 * (36 + 1) + 3 > available  # + 1: the inbox monitor


def test_the_budget_counts_the_engine_of_kafka_database_offsets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Kafka store's second engine (2 + 2) is in every pod unless both Kafka database
    modes are off: with both off the shipped figures lose it, and at the pool size of
    the other brokers (10) they would no longer fit with it, and the check says so."""
    rendered = copy.deepcopy(list(render("kafka")))
    for doc in rendered:
        if doc["kind"] == "ConfigMap":
            doc["data"]["WORKER_KAFKA_OFFSETS"] = "broker"
            doc["data"]["WORKER_DELIVERY_COUNTS"] = "broker"
    import tests.ops.test_deploy_manifests as me

    _, _, before = connection_budget("kafka")
    monkeypatch.setattr(me, "render", lambda _overlay: tuple(rendered))
    monkeypatch.setattr(me, "config", lambda _overlay: one(tuple(rendered), "ConfigMap")["data"])
    _, _, without = connection_budget("kafka")
    assert without["per_pod"] == before["per_pod"] - 4
    for doc in rendered:
        if doc["kind"] == "ConfigMap":
            doc["data"]["WORKER_DELIVERY_COUNTS"] = "database"
            doc["data"]["WORKER_DB_POOL_SIZE"] = "10"
    needed, available, figures = connection_budget("kafka")
    assert figures["per_pod"] == 10 + 1 + 1 + 4
    assert needed == 6 * 16 + 3 > available


def test_the_engine_opens_what_the_budget_counts() -> None:
    """pool + overflow is what SQLAlchemy's pool will really hold (no connection is made)."""
    from worker.db import create_engine

    env = config("rabbitmq")
    engine = create_engine(
        "postgresql+asyncpg://worker@127.0.0.1:1/worker",
        pool_size=int(env["WORKER_DB_POOL_SIZE"]),
        max_overflow=int(env["WORKER_DB_MAX_OVERFLOW"]),
    )
    pool: Any = engine.sync_engine.pool
    assert pool.size() == int(env["WORKER_DB_POOL_SIZE"])
    assert pool._max_overflow == int(env["WORKER_DB_MAX_OVERFLOW"])
    assert int(env["WORKER_DB_POOL_SIZE"]) >= int(env["WORKER_CONCURRENCY"]) + 2


# -- 3: Kafka rollouts that finish ---------------------------------------------------


def test_every_kafka_group_member_can_own_a_partition() -> None:
    """An idle member is ready (worker/brokers/kafka/consumer.py), so nothing hangs; still, a pod
    beyond the partition count only idles: minReplicaCount <= maxReplicaCount + maxSurge
    <= partitions, and no surge on Kafka (it buys nothing but one more rebalance).
    """
    spec = scaled("kafka")["spec"]
    partitions = int(scaled("kafka")["metadata"]["annotations"][PARTITIONS])
    strategy = deployment("kafka")["spec"]["strategy"]["rollingUpdate"]
    assert strategy == {"maxSurge": 0, "maxUnavailable": 1}
    assert spec["minReplicaCount"] <= spec["maxReplicaCount"] + strategy["maxSurge"]
    assert spec["maxReplicaCount"] + strategy["maxSurge"] <= partitions
    assert spec["triggers"][0]["metadata"]["allowIdleConsumers"] == "false"
    compose_partitions = compose()["services"]["kafka"]["environment"]["KAFKA_NUM_PARTITIONS"]
    assert int(compose_partitions) == partitions  # the example topic has that many


# -- 10: an outage must not become a stampede --------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_scaling_has_a_fallback_and_bounded_steps(overlay: str) -> None:
    spec = scaled(overlay)["spec"]
    fallback = spec["fallback"]
    assert fallback["failureThreshold"] >= 3
    assert spec["minReplicaCount"] <= fallback["replicas"] <= spec["maxReplicaCount"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    [up] = behavior["scaleUp"]["policies"]
    assert up["type"] == "Pods" and up["value"] <= 2 and up["periodSeconds"] >= 60
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300
    # cooldownPeriod only governs scaling to and from zero: inert above it
    if spec["minReplicaCount"] > 0:
        assert "cooldownPeriod" not in spec


# -- gaps: placement and pod hygiene -------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_spread_over_zones_and_settle_before_the_rollout_moves_on(overlay: str) -> None:
    spec = deployment(overlay)["spec"]
    keys = {c["topologyKey"] for c in spec["template"]["spec"]["topologySpreadConstraints"]}
    assert {"topology.kubernetes.io/zone", "kubernetes.io/hostname"} <= keys
    assert spec["minReadySeconds"] >= 5
    for kind in ("Deployment", "Job"):
        assert pod(overlay, kind)["enableServiceLinks"] is False
    [worker] = spec["template"]["spec"]["containers"]
    cpu = worker["resources"]["requests"]["cpu"]
    assert int(cpu.removesuffix("m")) >= 250 if cpu.endswith("m") else float(cpu) >= 0.25
    assert "cpu" not in worker["resources"].get("limits", {})  # throttling stalls the loop


# -- 6: Service Bus credentials -------------------------------------------------------


def test_keda_and_the_worker_use_different_service_bus_credentials() -> None:
    docs = render("servicebus")
    auth = one(docs, "TriggerAuthentication")
    [ref] = auth["spec"]["secretTargetRef"]
    worker_secrets = {
        source["secretRef"]["name"]
        for source in pod("servicebus")["containers"][0]["envFrom"]
        if "secretRef" in source
    }
    assert ref["name"] not in worker_secrets
    assert "azure-identity" in locked()  # the image's workload-identity path ([azure])


# -- 11: NetworkPolicies ------------------------------------------------------------------


def policies(overlay: str) -> list[dict[str, Any]]:
    return [doc for doc in render(overlay) if doc["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_select_only_this_worker_s_pods(overlay: str) -> None:
    for policy in policies(overlay):
        selector = policy["spec"]["podSelector"]["matchLabels"]
        assert selector.get("app.kubernetes.io/part-of") == "idempotent-worker"
        for kind in ("Deployment", "Job"):
            labels = one(render(overlay), kind)["spec"]["template"]["metadata"]["labels"]
            assert selector.items() <= labels.items(), kind


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_ops_port_is_open_to_the_monitoring_namespace_only(overlay: str) -> None:
    base = one(render(overlay), "NetworkPolicy", "worker")
    for rule in base["spec"]["ingress"]:
        assert rule.get("from"), "an ingress rule without `from` admits every pod"
        for peer in rule["from"]:
            assert "namespaceSelector" in peer and peer["namespaceSelector"]["matchLabels"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_dns_works_with_node_local_dns_and_openshift(overlay: str) -> None:
    base = one(render(overlay), "NetworkPolicy", "worker")
    dns = [
        rule for rule in base["spec"]["egress"] if {p["port"] for p in rule["ports"]} & {53, 5353}
    ]
    assert len(dns) == 1
    [rule] = dns
    # any destination: NodeLocal DNSCache's 169.254.20.10 is no pod a selector matches
    assert "to" not in rule
    assert {(p["port"], p["protocol"]) for p in rule["ports"]} == {
        (53, "UDP"),
        (53, "TCP"),
        (5353, "UDP"),
        (5353, "TCP"),
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_database_and_broker_may_live_in_other_namespaces(overlay: str) -> None:
    for policy in policies(overlay):
        for rule in policy["spec"]["egress"]:
            for peer in rule.get("to", []):
                # a podSelector alone only matches pods in the worker's own namespace
                assert "namespaceSelector" in peer or "ipBlock" in peer, policy["metadata"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_egress_reaches_the_collector_and_the_mail_api_but_not_the_metadata_service(
    overlay: str,
) -> None:
    base = one(render(overlay), "NetworkPolicy", "worker")
    by_port = {p["port"]: rule for rule in base["spec"]["egress"] for p in rule["ports"]}
    assert {4317, 4318, 443} <= set(by_port)
    [https] = by_port[443]["to"]
    excluded = [ipaddress.ip_network(cidr) for cidr in https["ipBlock"]["except"]]
    assert any(ipaddress.ip_address("169.254.169.254") in net for net in excluded)
    assert any(ipaddress.ip_address("10.1.2.3") in net for net in excluded)


# -- 9: PID 1 -------------------------------------------------------------------------------


def test_the_image_runs_the_worker_under_an_init() -> None:
    final = stages(dockerfile_instructions())[-1]
    entrypoint = yaml.safe_load(dict(final)["ENTRYPOINT"])
    assert entrypoint[0].endswith("/tini") and entrypoint[1:] == ["--", "worker"]
    copies = [rest for keyword, rest in final if keyword == "COPY"]
    assert any(rest.endswith(entrypoint[0]) for rest in copies)


def test_compose_runs_an_init_pins_its_images_and_starts_only_one_broker() -> None:
    services = compose()["services"]
    for name, service in services.items():
        image = service["image"]
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        assert tag and tag != "latest" and not tag.endswith("-latest"), f"{name}: {image}"
        if image.startswith("idempotent-worker"):
            assert service["init"] is True, name
    always = {name for name, service in services.items() if not service.get("profiles")}
    assert always == {"postgres", "migrate"}
    profiles: dict[str, set[str]] = {}
    for name, service in services.items():
        for profile in service.get("profiles", []):
            profiles.setdefault(profile, set()).add(name)
    assert profiles == {
        "rabbitmq": {"rabbitmq", "worker"},
        "kafka": {"kafka", "worker-kafka"},
        "servicebus": {"sqlserver", "servicebus", "worker-servicebus"},
    }
    assert "--profile rabbitmq up" in COMPOSE.read_text()


# -- gaps: a plain HPA instead of KEDA, a PodMonitor ---------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_plain_hpa_component_replaces_keda_within_the_same_budget(
    overlay: str, tmp_path: Path
) -> None:
    from tests.ops.test_ops_manifests import problems

    docs = render_with(overlay, "plain-hpa", directory=tmp_path)
    assert not [doc for doc in docs if doc["apiVersion"].startswith("keda.sh/")]
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert problems(hpa) == []
    assert hpa["spec"]["scaleTargetRef"]["name"] == one(docs, "Deployment")["metadata"]["name"]
    assert "replicas" not in one(docs, "Deployment")["spec"]
    keda = scaled(overlay)["spec"]
    assert hpa["spec"]["minReplicas"] == keda["minReplicaCount"]
    assert hpa["spec"]["maxReplicas"] <= keda["maxReplicaCount"]  # so the budget holds


def test_the_podmonitor_component_scrapes_the_consumers(tmp_path: Path) -> None:
    from tests.ops.test_ops_manifests import problems

    docs = render_with("rabbitmq", "podmonitor", directory=tmp_path)
    monitor = one(docs, "PodMonitor")
    assert problems(monitor) == []
    broken = copy.deepcopy(monitor)
    broken["spec"]["podMetricsEndpoints"][0]["intervall"] = "30s"
    assert problems(broken)  # the schema is awake
    labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    [container] = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert endpoint["port"] in {port["name"] for port in container["ports"]}
    assert endpoint["path"] == "/metrics"


def test_the_kafka_sasl_component_gives_keda_its_own_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.ops.test_ops_manifests import problems
    from worker.brokers.kafka import KafkaSettings
    from worker.settings import load

    docs = render_with("kafka", "kafka-sasl", directory=tmp_path)
    [trigger] = one(docs, "ScaledObject")["spec"]["triggers"]
    auth = one(docs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    assert problems(auth) == []
    refs = {ref["parameter"]: ref for ref in auth["spec"]["secretTargetRef"]}
    assert set(refs) == {"sasl", "username", "password", "tls"}
    for ref in refs.values():
        assert ref["key"] in secret_templates()[ref["name"]]
    assert secret_templates()["worker-keda-kafka"]["sasl"] in {
        "plaintext",
        "scram_sha256",
        "scram_sha512",
    }
    env = one(docs, "ConfigMap")["data"]
    for name in [n for n in os.environ if n.startswith("WORKER_")]:
        monkeypatch.delenv(name)
    for name, value in {**env, **secret_template()}.items():
        monkeypatch.setenv(name, value)
    kafka = load(KafkaSettings)
    assert kafka.security_protocol == "SASL_SSL"
    # the worker and KEDA speak the same mechanism
    keda_mode = secret_templates()["worker-keda-kafka"]["sasl"]
    assert kafka.sasl_mechanism.lower().replace("-", "") == keda_mode.replace("_", "")
    assert kafka.sasl_username and kafka.sasl_password


def test_the_namespace_component_enforces_the_restricted_pod_security_level(
    tmp_path: Path,
) -> None:
    docs = render_with("rabbitmq", "namespace", directory=tmp_path, namespace="billing")
    namespace = one(docs, "Namespace")
    assert namespace["metadata"]["name"] == "billing"
    labels = namespace["metadata"]["labels"]
    for mode in ("enforce", "audit", "warn"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted"
    for kind in ("Deployment", "Job"):
        assert one(docs, kind)["metadata"]["namespace"] == "billing"
        spec = one(docs, kind)["spec"]["template"]["spec"]
        # what `restricted` demands of every container
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for container in every_container(spec):
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]


# -- the image: a hash-locked dependency layer before the source, a base pinned by digest --


def locked() -> dict[str, tuple[str, list[str]]]:
    """deploy/requirements.lock: name -> (version, its sha256 hashes)."""
    pins: dict[str, tuple[str, list[str]]] = {}
    name = ""
    for raw in (DEPLOY / "requirements.lock").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not raw.startswith(" "):
            spec, _, _ = line.partition(" ")
            name, _, version = spec.partition("==")
            assert version, f"not a pin: {line}"
            pins[canonicalize_name(name)] = (version, [])
        elif line.startswith("--hash=sha256:"):
            pins[canonicalize_name(name)][1].append(line.split(":", 1)[1].rstrip(" \\"))
    return pins


def test_the_image_installs_every_dependency_from_a_hash_locked_file() -> None:
    import tomllib

    build = stages(dockerfile_instructions())[0]
    runs = [rest for keyword, rest in build if keyword == "RUN"]
    assert any("--require-hashes -r requirements.lock" in r and "--no-deps" in r for r in runs)
    pins = locked()
    for name, (_version, hashes) in pins.items():
        assert hashes and all(len(h) == 64 for h in hashes), name
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    wanted = [*project["project"]["dependencies"], *project["build-system"]["requires"]]
    for extra in ("otel", "azure"):  # what the image installs
        wanted += project["project"]["optional-dependencies"][extra]
    for spec in wanted:
        requirement = Requirement(spec)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is not locked"
        assert requirement.specifier.contains(pins[name][0], prereleases=True), (spec, pins[name])
    # closed: what a locked distribution needs is locked too (by the metadata installed here)
    for pinned in pins:
        try:
            requires = metadata.requires(pinned) or []
        except metadata.PackageNotFoundError:
            continue
        for spec in requires:
            requirement = Requirement(spec)
            if requirement.marker is not None and not requirement.marker.evaluate(
                {"extra": "", "python_version": "3.12", "python_full_version": "3.12.0"}
            ):
                continue
            assert canonicalize_name(requirement.name) in pins, f"{pinned} needs {spec}"


def test_the_package_is_built_offline_after_the_dependency_layer() -> None:
    """A code change must not reinstall the dependencies: the lock is copied and installed
    before any source is copied, and the package itself installs with nothing fetched."""
    build = stages(dockerfile_instructions())[0]
    keywords = [(keyword, rest) for keyword, rest in build if keyword in ("COPY", "RUN")]
    lock = next(i for i, (k, r) in enumerate(keywords) if k == "COPY" and "requirements.lock" in r)
    deps = next(i for i, (k, r) in enumerate(keywords) if k == "RUN" and "--require-hashes" in r)
    sources = [i for i, (k, r) in enumerate(keywords) if k == "COPY" and (
        "worker" in r.split() or "pyproject.toml" in r)]  # fmt: skip
    assert lock < deps < min(sources)
    [package] = [r for k, r in keywords if k == "RUN" and "--no-build-isolation" in r]
    assert "--no-index" in package and "--no-deps" in package


def test_the_base_image_is_pinned_by_digest_and_the_revision_reaches_the_worker() -> None:
    import re

    instructions = dockerfile_instructions()
    base = next(rest for keyword, rest in instructions if keyword == "ARG")
    assert re.fullmatch(r"PYTHON_IMAGE=python:3\.12-slim-bookworm@sha256:[0-9a-f]{64}", base)
    final = stages(instructions)[-1]
    assert ("ARG", "REVISION=unknown") in final
    from worker.metrics import REVISION_VARIABLE

    assert ("ENV", f"{REVISION_VARIABLE}=${{REVISION}}") in final
    assert not REVISION_VARIABLE.startswith("WORKER_")  # no setting: no unknown-variable warning


# -- renaming: a prefix and an instance label, two instances in one namespace ------------


def instance(directory: Path, name: str, overlay: str = "rabbitmq") -> tuple[dict[str, Any], ...]:
    """A user's kustomization: the overlay (and the PodMonitor) as ``<name>-worker``, labelled
    ``app.kubernetes.io/instance: <name>`` down to every selector, in namespace ``shared``."""
    directory.mkdir()
    relative = Path(os.path.relpath(DEPLOY, directory))
    spec = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": "shared",
        "namePrefix": f"{name}-",
        "labels": [{"pairs": {"app.kubernetes.io/instance": name}, "includeSelectors": True}],
        "resources": [str(relative / "overlays" / overlay)],
        "components": [str(relative / "components" / "podmonitor")],
    }
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    result = run(tool("kubectl"), "kustomize", str(directory))
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def selectors_of(docs: tuple[dict[str, Any], ...]) -> list[tuple[str, dict[str, str]]]:
    found = []
    for doc in docs:
        spec, kind = doc.get("spec", {}), doc["kind"]
        if kind in ("Deployment", "PodDisruptionBudget", "PodMonitor"):
            found.append((kind, spec["selector"]["matchLabels"]))
        elif kind == "Service":
            found.append((kind, spec["selector"]))
        elif kind == "NetworkPolicy":
            found.append((kind, spec["podSelector"]["matchLabels"]))
    return found


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_name_prefix_renames_what_keda_scales_and_authenticates_with(
    overlay: str, tmp_path: Path
) -> None:
    docs = instance(tmp_path / "billing", "billing", overlay)
    deployment = one(docs, "Deployment")["metadata"]["name"]
    assert deployment == "billing-worker"
    scaled = one(docs, "ScaledObject")["spec"]
    assert scaled["scaleTargetRef"]["name"] == deployment
    names = {doc["metadata"]["name"] for doc in docs if doc["kind"] == "TriggerAuthentication"}
    for trigger in scaled["triggers"]:
        if "authenticationRef" in trigger:
            assert trigger["authenticationRef"]["name"] in names
    assert one(docs, "Job")["metadata"]["name"] == "billing-worker-migrate"


def test_without_the_kustomize_configuration_keda_would_scale_nothing(tmp_path: Path) -> None:
    """The check is awake: the overlay without its ``configurations:`` renders the old bug."""
    import shutil

    copy_of = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy_of, ignore=shutil.ignore_patterns("helm"))
    overlay = copy_of / "overlays" / "rabbitmq" / "kustomization.yaml"
    spec = yaml.safe_load(overlay.read_text())
    del spec["configurations"]
    overlay.write_text(yaml.safe_dump(spec))
    user = tmp_path / "billing"
    user.mkdir()
    (user / "kustomization.yaml").write_text(
        yaml.safe_dump({"namePrefix": "billing-", "resources": ["../deploy/overlays/rabbitmq"]})
    )
    result = run(tool("kubectl"), "kustomize", str(user))
    assert result.returncode == 0, result.stderr
    docs = tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)
    assert one(docs, "ScaledObject")["spec"]["scaleTargetRef"]["name"] == "worker"


def test_two_kustomize_instances_in_one_namespace_never_select_each_other(tmp_path: Path) -> None:
    billing = instance(tmp_path / "billing", "billing")
    refunds = instance(tmp_path / "refunds", "refunds", "kafka")
    names = [(d["kind"], d["metadata"]["name"]) for d in (*billing, *refunds)]
    assert len(names) == len(set(names))
    for mine, theirs in ((billing, refunds), (refunds, billing)):
        own = one(mine, "Deployment")["spec"]["template"]["metadata"]["labels"]
        other = [one(theirs, kind)["spec"]["template"]["metadata"]["labels"]
                 for kind in ("Deployment", "Job")]  # fmt: skip
        for kind, selector in selectors_of(mine):
            assert selector.items() <= own.items(), kind
            for labels in other:
                assert not selector.items() <= labels.items(), (kind, selector)


def test_every_overlay_carries_the_same_kustomize_configuration() -> None:
    texts = {(DEPLOY / "overlays" / o / "kustomizeconfig.yaml").read_text() for o in OVERLAYS}
    assert len(texts) == 1
