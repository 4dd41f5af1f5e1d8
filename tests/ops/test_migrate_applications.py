"""The application owns its tables: its migration history lives beside its handlers, the
worker's beside the worker's code, and ``worker migrate`` runs both, the worker's first.

The user's package is made in a temporary folder outside this repository, the way a user
has it after ``pip install idempotent-worker``: the project folder is the working directory
(not on PYTHONPATH), the ``worker`` command is the console script pip writes, and
PYTHONPATH names this repository only because that is where the installed worker would be.
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import subprocess
import sys
import sysconfig
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.ops.deploy_helpers import cli_env, throwaway_database
from tests.support.migrations import migrate_with_the_example
from tests.support.processes import console_script, json_lines, run_cli
from worker import histories
from worker.db import create_engine
from worker.errors import ConfigurationError
from worker.histories import (
    VERSION_TABLE,
    WORKER_TABLES,
    History,
    application_history,
    history_to_write,
    skip_worker_tables,
)
from worker.migrate import heads, revision, upgrade

ORDERS = '''\
"""The newcomer's first handler with a table of its own."""

from decimal import Decimal

from pydantic import BaseModel
from sqlalchemy import Integer, Numeric, String
from sqlalchemy.orm import Mapped, mapped_column

from worker import Base, Context, handler, insert_ignoring_conflicts


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    total: Mapped[Decimal] = mapped_column(Numeric(18, 2))
    version: Mapped[int] = mapped_column(Integer, nullable=False)

    __mapper_args__ = {"version_id_col": version}


class OrderPlaced(BaseModel):
    order_id: str
    total: Decimal


@handler("OrderPlaced", OrderPlaced, consumer="orders")
async def place_order(ctx: Context, message: OrderPlaced) -> None:
    row = {"id": message.order_id, "total": message.total, "version": 1}
    await ctx.session.execute(insert_ignoring_conflicts(ctx.session, Order).values(row))
'''


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'shop.db'}"
        return
    with throwaway_database() as url:
        yield url


def project(root: Path) -> Path:
    """``myproject/shop/orders.py``: a package of the user's own, no migrations yet."""
    (root / "shop").mkdir(parents=True)
    (root / "shop" / "__init__.py").write_text("")
    (root / "shop" / "orders.py").write_text(ORDERS)
    return root


def on_database(url: str, work: Any) -> Any:
    async def run() -> Any:
        engine = create_engine(url, pool_size=1)
        try:
            async with engine.begin() as connection:
                return await connection.run_sync(work)
        finally:
            await engine.dispose()

    return asyncio.run(run())


def tables(url: str) -> set[str]:
    return set(on_database(url, lambda c: sa.inspect(c).get_table_names()))


def versions(url: str, table: str) -> list[str]:
    return sorted(on_database(url, lambda c: c.scalars(sa.text(f"SELECT * FROM {table}")).all()))


def upgrade_section(path: Path) -> str:
    """The body of a revision's ``upgrade()``: what ``worker migrate`` would run."""
    return path.read_text().split("def upgrade", 1)[1].split("def downgrade", 1)[0]


def test_a_users_package_brings_its_own_table_and_revision(database: str, tmp_path: Path) -> None:
    root = project(tmp_path / "myproject")
    worker = console_script(tmp_path)
    env = cli_env(database, WORKER_HANDLERS="shop.orders")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return run_cli(env, *args, cwd=root, launcher=worker, timeout=120)

    first = cli("migrate")  # the worker's tables; the model has no revision yet
    assert first.returncode == 0, first.stderr
    [missing] = [line for line in json_lines(first.stderr) if "missing" in line["event"]]
    assert missing["tables"] == ["orders"]
    gate = cli("migrate", "--check")
    assert gate.returncode == 1 and "tables missing: orders" in gate.stderr

    made = cli("revision", "-m", "orders", "--autogenerate")
    assert made.returncode == 0, made.stderr
    [written] = (root / "shop" / "migrations" / "versions").glob("*_orders.py")
    assert str(written) in made.stdout
    body = upgrade_section(written)
    assert "create_table('orders'" in body
    # the worker's tables are in the database and in no model of shop's: never dropped
    assert "drop" not in body and not any(f"'{name}'" in body for name in WORKER_TABLES)

    migrated = cli("migrate")
    assert migrated.returncode == 0, migrated.stderr
    present = tables(database)
    assert {"orders", "shop_alembic_version", *WORKER_TABLES} <= present
    assert not present & {"accounts", "products", "handlers_alembic_version"}  # not named
    assert versions(database, "shop_alembic_version") == [written.name.split("_", 1)[0]]
    at_head = cli("migrate", "--check")
    assert at_head.returncode == 0, at_head.stderr
    assert "shop: database at" in at_head.stderr

    # the next revision of the application, not migrated yet: the gate stays shut
    later = cli("revision", "-m", "order notes")
    assert later.returncode == 0, later.stderr
    behind = cli("migrate", "--check")
    assert behind.returncode == 1
    [line] = [line for line in json_lines(behind.stderr) if line["event"] == "schema not at head"]
    assert (
        line["status"].startswith("schema behind: worker: database at")
        and "shop:" in line["status"]
    )
    assert cli("migrate").returncode == 0
    assert cli("migrate", "--check").returncode == 0


def test_a_revision_is_never_written_into_an_installed_package() -> None:
    """A package imported from site-packages (the example ``handlers`` after ``pip install``,
    or the user's own, installed): a revision written there would be lost with the next
    install and never reach the user's repository."""
    installed = Path(sysconfig.get_paths()["purelib"]) / f"shop_{uuid.uuid4().hex[:8]}"
    history = History(installed.name, installed / "migrations" / "versions", installed.name)
    with pytest.raises(ConfigurationError, match="in an installed package"):
        revision(history, "lost")
    assert not installed.exists()


def test_worker_revision_asks_which_application_when_several_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first revision goes beside the module named (its package's migrations/versions/);
    with two applications named, --application says which."""
    tag = uuid.uuid4().hex[:8]
    for name in (f"shop_{tag}", f"billing_{tag}"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
        (tmp_path / name / "handlers.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    shop, billing = f"shop_{tag}.handlers", f"billing_{tag}.handlers"

    assert history_to_write([shop]).versions == tmp_path / f"shop_{tag}" / "migrations" / "versions"
    with pytest.raises(ConfigurationError, match="names 2 applications"):
        history_to_write([shop, billing])
    chosen = history_to_write([shop, billing], f"billing_{tag}")
    assert (
        chosen.name == f"billing_{tag}" and chosen.version_table == f"billing_{tag}_alembic_version"
    )
    with pytest.raises(ConfigurationError, match="is not one of"):
        history_to_write([shop], "shop")


def test_the_worker_history_creates_the_worker_tables_only(tmp_path: Path) -> None:
    """WORKER_TABLES is what the autogenerate filters go by: it must name every table the
    worker's history creates, and none of the example application's."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'worker.db'}"
    upgrade(url)
    assert tables(url) == WORKER_TABLES | {VERSION_TABLE}


def test_a_users_revision_next_to_a_new_worker_revision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two heads no more: a user who wrote revision ``0005`` (into the worker's history, as
    the old README had it) and the worker's next release with its own ``0005`` made
    ``worker migrate`` fail with "Multiple head revisions". In their own histories both apply,
    even under the same revision id."""
    [head] = heads()
    following = f"{int(head) + 1:04d}"
    worker_versions = tmp_path / "worker_versions"
    shutil.copytree(histories.WORKER.versions, worker_versions, ignore=ignore_caches)
    write_revision(worker_versions / f"{following}_next.py", following, head, "worker_next_release")
    monkeypatch.setattr(histories, "WORKER", History("worker", worker_versions))

    package = f"shop_{uuid.uuid4().hex[:8]}"
    (tmp_path / package / "migrations" / "versions").mkdir(parents=True)
    (tmp_path / package / "__init__.py").write_text("")
    user = tmp_path / package / "migrations" / "versions" / f"{following}_orders.py"
    write_revision(user, following, None, "orders", after="worker_next_release")  # worker first
    monkeypatch.syspath_prepend(str(tmp_path))
    shop = application_history(package)
    assert shop is not None and shop.name == package

    url = f"sqlite+aiosqlite:///{tmp_path / 'both.db'}"
    upgrade(url, applications=[shop])
    assert {"worker_next_release", "orders"} <= tables(url)
    assert versions(url, VERSION_TABLE) == [following]
    assert versions(url, shop.version_table) == [following]


def ignore_caches(_directory: str, names: list[str]) -> list[str]:
    return [name for name in names if name == "__pycache__"]


def write_revision(
    path: Path, rev: str, down: str | None, table: str, after: str | None = None
) -> None:
    """A revision creating ``table``; it fails unless ``after`` already exists."""
    check = f"assert sa.inspect(op.get_bind()).has_table({after!r}), 'too early'" if after else ""
    path.write_text(
        textwrap.dedent(
            f"""\
            import sqlalchemy as sa
            from alembic import op

            revision = {rev!r}
            down_revision = {down!r}
            branch_labels = None
            depends_on = None


            def upgrade() -> None:
                {check}
                op.create_table({table!r}, sa.Column("id", sa.Integer(), primary_key=True))


            def downgrade() -> None:
                op.drop_table({table!r})
            """
        )
    )


def test_each_autogenerate_compares_only_the_tables_its_history_owns(tmp_path: Path) -> None:
    """In one database with the worker's tables, the example application's and a table that
    is nobody's model: the worker's autogenerate proposes nothing about the application's
    tables, the application's nothing about the worker's, and neither drops the stray one."""
    import handlers.credit
    import handlers.pricing  # noqa: F401

    url = f"sqlite+aiosqlite:///{tmp_path / 'shared.db'}"
    migrate_with_the_example(url)
    on_database(url, lambda c: c.execute(sa.text("CREATE TABLE reports (id INTEGER PRIMARY KEY)")))
    example = application_history("handlers")
    assert example is not None
    for history in (histories.WORKER, example):
        copy = tmp_path / history.name
        shutil.copytree(history.versions, copy, ignore=ignore_caches)
        written = revision(
            History(history.name, copy, history.package), "compare", database_url=url
        )
        body = upgrade_section(written)
        assert "op." not in body, f"{history.name}'s autogenerate proposed:\n{body}"


OWN_ENV = '''\
"""An application's own Alembic environment (what `alembic init` writes, reduced)."""

import os

from alembic import context
from sqlalchemy import engine_from_config, pool

from shop.models import ShopBase
from worker.histories import skip_worker_tables

config = context.config
connectable = engine_from_config(
    config.get_section(config.config_ini_section, {}), prefix="sqlalchemy.", poolclass=pool.NullPool
)
hooks = {} if os.environ.get("SHOP_NO_FILTER") else {"include_name": skip_worker_tables}
with connectable.connect() as connection:
    context.configure(connection=connection, target_metadata=ShopBase.metadata, **hooks)
    with context.begin_transaction():
        context.run_migrations()
'''

OWN_MODELS = """\
from sqlalchemy import Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class ShopBase(DeclarativeBase):
    pass


class Invoice(ShopBase):
    __tablename__ = "invoices"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, nullable=False)
"""

OWN_REVISION = """\
import sqlalchemy as sa
from alembic import op

revision = "a1"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "invoices",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("version", sa.Integer(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("invoices")
"""


def test_an_application_with_its_own_alembic_takes_the_worker_tables_beside(
    tmp_path: Path,
) -> None:
    """``worker migrate --worker-only`` brings the worker's tables (its own history, its own
    version table); the application's ``alembic upgrade`` its own; and its autogenerate,
    with ``include_name=skip_worker_tables``, sees nothing to do about the worker's tables.
    Without the filter it would drop them all."""
    root = tmp_path / "billing"
    (root / "shop" / "migrations" / "versions").mkdir(parents=True)
    (root / "shop" / "__init__.py").write_text("")
    (root / "shop" / "models.py").write_text(OWN_MODELS)
    (root / "shop" / "handlers.py").write_text("from shop.models import Invoice  # noqa: F401\n")
    (root / "shop" / "migrations" / "env.py").write_text(OWN_ENV)
    (root / "shop" / "migrations" / "versions" / "a1_invoices.py").write_text(OWN_REVISION)
    path = tmp_path / "billing.db"
    (root / "alembic.ini").write_text(
        f"[alembic]\nscript_location = shop/migrations\nsqlalchemy.url = sqlite:///{path}\n"
    )
    env = cli_env(f"sqlite+aiosqlite:///{path}", WORKER_HANDLERS="shop.handlers")
    worker = console_script(tmp_path)

    def alembic(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "alembic", *args],
            env={**env, **extra},  # python -m puts the project folder on sys.path
            cwd=root,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    first = run_cli(env, "migrate", "--worker-only", cwd=root, launcher=worker)
    assert first.returncode == 0, first.stderr
    upgraded = alembic("upgrade", "head")
    assert upgraded.returncode == 0, upgraded.stderr

    with sqlite3.connect(path) as connection:
        names = {row[0] for row in connection.execute("SELECT name FROM sqlite_master")}
    assert {"invoices", "alembic_version", VERSION_TABLE, *WORKER_TABLES} <= names

    checked = alembic("check")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    unfiltered = alembic("check", SHOP_NO_FILTER="1")
    assert unfiltered.returncode != 0 and "remove_table" in unfiltered.stderr + unfiltered.stdout
    assert "inbox" in unfiltered.stderr + unfiltered.stdout

    # its migrations/ has an env.py: the worker leaves it to the application's own Alembic
    for flags in ((), ("--worker-only",)):
        gate = run_cli(env, "migrate", "--check", *flags, cwd=root, launcher=worker)
        assert gate.returncode == 0, gate.stderr
    assert versions(f"sqlite+aiosqlite:///{path}", VERSION_TABLE) == list(heads())


def test_skip_worker_tables_leaves_the_applications_own() -> None:
    assert not skip_worker_tables("inbox", "table", {})
    assert not skip_worker_tables(VERSION_TABLE, "table", {})
    assert not skip_worker_tables("alembic_version", "table", {})
    assert skip_worker_tables("invoices", "table", {})
    assert skip_worker_tables("inbox", "column", {"table_name": "inbox"})
    # the partitioned inbox's tables are the worker's too (WORKER_INBOX_LAYOUT=partitioned)
    for partition in ("inbox_p20261203t000000", "inbox_default", "inbox_legacy"):
        assert not skip_worker_tables(partition, "table", {})
    assert skip_worker_tables("inbox_orders", "table", {})
