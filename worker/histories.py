"""Whose tables are whose: the worker's migration history, and each application's.

The worker's own tables (the inbox, which also holds the side-effect claims, the
rejections, the outbox, Kafka's ``consumer_offsets`` and ``delivery_counts``) are
created by the worker's history, shipped inside the package and recorded in the
version table ``worker_alembic_version``. An application's tables are created by the
application's history, which lives beside its handlers and is recorded in a version
table of its own (``shop_alembic_version`` for the package ``shop``). The histories
never share a revision, so a user's revision can never become a second head next to a
new release of the worker, and each history's autogenerate compares only the tables it
owns: neither proposes to drop the other's.

An application declares its history by convention, the way its handlers are found:
a ``migrations/versions/`` folder in the package of a module named by WORKER_HANDLERS,
or in a package above it (the nearest one wins). A ``migrations/`` folder that holds an
``env.py`` of its own belongs to an application that runs its own Alembic environment
(``alembic init``, Flask-Migrate): the worker leaves it alone.
"""

from __future__ import annotations

import importlib.util
import site
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from worker.db import Base
from worker.errors import ConfigurationError
from worker.partitions import is_inbox_partition
from worker.registry import cannot_import

WORKER_TABLES = frozenset({"inbox", "rejections", "outbox", "consumer_offsets", "delivery_counts"})
"""The tables the worker's history creates: never an application's. A worker revision that
adds a table adds its name here (tests/ops/test_migrate_applications.py checks it)."""

VERSION_TABLE_SUFFIX = "_alembic_version"
LEGACY_VERSION_TABLE = "alembic_version"
"""Where releases up to revision 0004 recorded the worker's revision and the example
handlers' tables together. An upgrade copies the worker's revision out of it and leaves it
as it is, so the previous release's gate still opens on a rollback."""

MIGRATIONS = Path(__file__).with_name("migrations")
"""The Alembic environment every history runs in (env.py, the revision template)."""


@dataclass(frozen=True)
class History:
    """One migration history: whose it is and where its revision files are."""

    name: str
    """``worker``, or the application's package (``shop``): names its version table."""
    versions: Path
    """The folder of its revision files."""
    package: str | None = None
    """The application's package; None for the worker's own history."""

    @property
    def version_table(self) -> str:
        return self.name.replace(".", "_") + VERSION_TABLE_SUFFIX

    @property
    def is_workers(self) -> bool:
        return self.package is None

    def tables(self) -> frozenset[str]:
        """The tables this history owns, which its autogenerate compares and nothing else.

        An application's are the tables of its models on :class:`worker.Base` (classes
        defined in its package or below), so its modules must have been imported.
        """
        return WORKER_TABLES if self.package is None else application_tables(self.package)


WORKER = History("worker", MIGRATIONS / "versions")
VERSION_TABLE = WORKER.version_table


def is_version_table(name: str) -> bool:
    """A table Alembic records a history's revision in: the worker's, an application's, or
    the single ``alembic_version`` of releases before the histories were split."""
    return name == LEGACY_VERSION_TABLE or name.endswith(VERSION_TABLE_SUFFIX)


def application_tables(package: str) -> frozenset[str]:
    """The tables of the models on :class:`worker.Base` defined in ``package`` or below."""
    prefix = package + "."
    found: set[str] = set()
    for mapper in Base.registry.mappers:
        module = mapper.class_.__module__
        if module == package or module.startswith(prefix):
            found.update(table.name for table in mapper.tables)
    return frozenset(found - WORKER_TABLES)


def model_tables() -> frozenset[str]:
    """Every table on :class:`worker.Base` that is not the worker's: what the handlers
    imported so far need to find in the database."""
    return frozenset(Base.metadata.tables) - WORKER_TABLES


def skip_worker_tables(name: str | None, type_: str, parent_names: object) -> bool:
    """An Alembic ``include_name`` hook for an application's own ``env.py``: False for the
    worker's tables and every version table, so ``alembic revision --autogenerate`` in your
    project never proposes to drop (or alter) them."""
    if type_ != "table" or name is None:
        return True
    return name not in WORKER_TABLES and not is_inbox_partition(name) and not is_version_table(name)


def _candidates(module: str) -> list[tuple[Path, str]]:
    """(directory, package) from the module's own package up to its top-level package.

    Found without importing the module itself (its parent packages are imported), so the
    test fixtures can migrate an application without registering its handlers.
    """
    try:  # imports the parent packages, whose __init__ may fail as any module may
        spec = importlib.util.find_spec(module)
    except Exception as exc:
        raise cannot_import(module, exc) from None
    if spec is None:
        raise ConfigurationError(f"WORKER_HANDLERS: cannot import {module!r}: no such module")
    if spec.submodule_search_locations:  # a package: its own folder first
        directory, package = Path(next(iter(spec.submodule_search_locations))), module
    elif spec.origin:  # a module: the folder it sits in, its package
        directory, package = Path(spec.origin).parent, module.rpartition(".")[0] or module
    else:
        raise ConfigurationError(f"WORKER_HANDLERS: {module!r} has no files to sit beside")
    found = [(directory, package)]
    while "." in package:
        directory, package = directory.parent, package.rpartition(".")[0]
        found.append((directory, package))
    return found


def _lookup(module: str) -> tuple[History | None, bool]:
    """The nearest ``migrations/`` folder above ``module``: its history (None when there is
    none), and whether it is an Alembic environment of the application's own."""
    for directory, package in _candidates(module):
        folder = directory / "migrations"
        if (folder / "env.py").exists():
            return None, True
        if (folder / "versions").is_dir():
            return History(package, folder / "versions", package), False
    return None, False


def application_history(module: str) -> History | None:
    """The history of the application ``module`` belongs to, or None when it has none (or
    runs an Alembic environment of its own)."""
    return _lookup(module)[0]


def application_histories(modules: Iterable[str]) -> tuple[History, ...]:
    """The histories of the applications ``modules`` (WORKER_HANDLERS) belong to, in the
    order they are named, each once."""
    found: dict[Path, History] = {}
    for module in modules:
        history = application_history(module)
        if history is not None:
            found.setdefault(history.versions.resolve(), history)
    return tuple(found.values())


def history_to_write(modules: Sequence[str], application: str | None = None) -> History:
    """Where ``worker revision`` writes: the history of the one application WORKER_HANDLERS
    names (``application`` picks one of several), created beside its handlers if new."""
    choices: dict[str, History] = {}
    for module in modules:
        history, own = _lookup(module)
        if own:
            continue  # its own Alembic environment: `alembic revision` there
        if history is None:  # the first revision: beside the module, in its package
            directory, package = _candidates(module)[0]
            history = History(package, directory / "migrations" / "versions", package)
        choices.setdefault(history.name, history)
    if application is not None:
        if application not in choices:
            named = ", ".join(sorted(choices)) or "none"
            raise ConfigurationError(
                f"worker revision: --application {application!r} is not one of WORKER_HANDLERS' "
                f"applications ({named})"
            )
        return choices[application]
    if len(choices) != 1:
        named = ", ".join(sorted(choices)) or "none"
        raise ConfigurationError(
            f"worker revision: WORKER_HANDLERS names {len(choices)} applications with "
            f"migrations of the worker's kind ({named}): say which with --application"
        )
    return next(iter(choices.values()))


def installed(path: Path) -> bool:
    """Whether ``path`` is inside an installed copy (site-packages), where a revision written
    would be lost with the next ``pip install`` and never reach your repository."""
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    roots.update(site.getsitepackages())
    roots.add(site.getusersitepackages())
    resolved = path.resolve()
    return any(resolved.is_relative_to(Path(root).resolve()) for root in roots)
