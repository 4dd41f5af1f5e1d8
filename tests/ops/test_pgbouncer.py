"""The worker behind PgBouncer in transaction mode (Debian's pgbouncer package, 1.18 here).

In transaction pooling every transaction may run on another server connection. What that
breaks, and what ``?pooler=transaction`` on WORKER_DATABASE_URL does about it:

- asyncpg prepares every statement, named and cached per client connection; another
  client's transaction on the same server connection then meets "prepared statement
  ... already exists", or its own statement "does not exist" on the next server
  connection. PgBouncer 1.21+ can track them (``max_prepared_statements``); 1.18 cannot.
  With the option, statements are unnamed and uncached. One outside a transaction (the
  delivery counts' autocommitted upsert) keeps its server connection from its prepare
  to its execute: asyncpg's prepare ends in Flush, and PgBouncer moves a client only at
  an idle ReadyForQuery.
- Session advisory locks (``worker migrate``, the inbox purge) would stay held on a
  server connection the unlock never reaches: those refuse such a URL and say which URL
  they need; the migration gate (``migrate --wait``) only reads and works through it.

The pool to the server is kept smaller than the clients' pools, so server connections
really change hands between transactions.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy.exc import DBAPIError

from tests.support.credits import credit_body, credit_registry
from tests.support.database import balances, execute, fetch, marker_count
from tests.support.processes import clean_env, free_port, run_cli
from tests.support.pumps import MakeSettings, RunPumps, engine_for
from tests.support.services import require_service, unavailable
from worker import attempts
from worker.brokers.memory import MemoryBroker
from worker.delivery import Delivery

pytestmark = pytest.mark.postgres

INSTALL = "apt-get install -y pgbouncer"


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def pgbouncer(tmp_path: Path) -> Iterator[int]:
    """A PgBouncer of this test's own on loopback, transaction pooling, 3 server
    connections per database, trusting the local PostgreSQL; its port."""
    binary = shutil.which("pgbouncer")  # Debian puts it in /usr/sbin
    if binary is None:
        unavailable(f"pgbouncer is not installed ({INSTALL})")
    require_service("127.0.0.1", 5432, "PostgreSQL")
    port = free_port()
    home = tmp_path / "pgbouncer"
    home.mkdir()
    (home / "users.txt").write_text('"postgres" ""\n')
    (home / "pgbouncer.ini").write_text(
        "[databases]\n"
        "* = host=127.0.0.1 port=5432\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {home / 'users.txt'}\n"
        "pool_mode = transaction\ndefault_pool_size = 3\nmax_client_conn = 200\n"
        "ignore_startup_parameters = extra_float_digits\n"
    )
    for path in (tmp_path, home, *home.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
    command = [binary, str(home / "pgbouncer.ini")]
    if os.geteuid() == 0:  # PgBouncer refuses to run as root
        command[1:1] = ["-u", "nobody"]
    log = (tmp_path / "pgbouncer.log").open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while not _listening(port):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"pgbouncer did not start: {(tmp_path / 'pgbouncer.log').read_text()}")
            time.sleep(0.05)
        yield port
    finally:
        process.send_signal(signal.SIGINT)  # PgBouncer's "shutdown at once"
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
        log.close()


def through(url: str, port: int, pooler: str | None = "transaction") -> str:
    """``url`` (the suite's database on 127.0.0.1:5432) through the PgBouncer on ``port``."""
    pooled = url.replace("@127.0.0.1:5432/", f"@127.0.0.1:{port}/")
    assert pooled != url, url
    return f"{pooled}?pooler={pooler}" if pooler else pooled


HOT_ACCOUNTS = 7
ROUNDS = 200


async def test_two_pumps_behind_transaction_pooling_apply_every_credit_once(
    pgbouncer: int, postgres_only_url: str, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    """Hot accounts, duplicates racing each other, lost acks (redeliveries, counted in the
    database on every start), two pumps of 8 each over 3 server connections."""
    url = through(postgres_only_url, pgbouncer)
    broker = MemoryBroker()
    expected: dict[str, Decimal] = {}
    for n in range(300):
        account, amount = f"acct-{n % HOT_ACCOUNTS}", Decimal(n % 13 + 1)
        expected[account] = expected.get(account, Decimal(0)) + amount
        broker.publish(
            f"m-{n}", "CreditRequested", credit_body(account, amount),
            copies=2 if n % 4 == 0 else 1, lose_acks=1 if n % 7 == 0 else 0,
        )  # fmt: skip
    settings = make_settings(
        database_url=url, concurrency=8, count_first_deliveries=True, max_deliveries=5
    )
    async with (
        engine_for(url, pool_size=8) as first,
        engine_for(url, pool_size=8) as second,
        run_pumps([broker.connect(), broker.connect()], [first, second], credit_registry(),
                  settings) as pumps,
    ):  # fmt: skip
        await broker.wait_idle(timeout=120)
    assert broker.dead_letters == []
    assert sum(pump.stats["committed"] for pump in pumps) == 300
    assert await balances(postgres_only_url) == expected
    assert await marker_count(postgres_only_url) == 300


def pooled_env(url: str) -> dict[str, str]:
    return {**clean_env(), "WORKER_DATABASE_URL": url, "WORKER_LOG_FORMAT": "json"}


def test_the_migration_gate_reads_through_transaction_pooling(
    pgbouncer: int, postgres_only_url: str
) -> None:
    url = through(postgres_only_url, pgbouncer)
    for gate in (("migrate", "--check"), ("migrate", "--wait", "--timeout", "20")):
        result = run_cli(pooled_env(url), *gate)
        assert result.returncode == 0, result.stderr
        assert "schema usable" in result.stderr + result.stdout


@pytest.mark.parametrize(
    ("command", "extra"),
    [(("migrate",), {}), (("purge-inbox",), {}), (("run",), {"WORKER_BROKER": "memory"})],
    ids=["migrate", "purge-inbox", "run with the purge on"],
)
def test_what_holds_a_session_lock_refuses_a_transaction_pooled_url(
    command: tuple[str, ...], extra: dict[str, str], pgbouncer: int, postgres_only_url: str
) -> None:
    url = through(postgres_only_url, pgbouncer)
    result = run_cli({**pooled_env(url), **extra}, *command)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "pooler=transaction" in lines[0] and "direct or session-pooled URL" in lines[0]


async def test_autocommitted_counts_and_refunds_each_run_their_own_statement(
    pgbouncer: int, postgres_only_url: str, make_settings: MakeSettings
) -> None:
    """A statement the worker runs outside a transaction (a delivery count, its refund)
    takes two round trips: asyncpg prepares it, then binds and executes it. Were PgBouncer
    to give the execute another server connection, the unnamed statement would be missing
    there ("does not exist"), or be another client's, run with this one's parameters.

    It does not: asyncpg ends the prepare with Flush, not Sync, so no ReadyForQuery comes
    back between the two and PgBouncer, which only hands a server connection on at an idle
    ReadyForQuery, keeps it with the client until the execute's Sync. The control shows
    this PgBouncer does move clients between two round trips that each end in
    ReadyForQuery (SQL ``PREPARE``, then ``EXECUTE``): then statements go missing."""
    await execute(
        postgres_only_url,
        "INSERT INTO delivery_counts (message_id, consumer, deliveries) "
        f"SELECT 'r-' || n, 'c', 5 FROM generate_series(0, {ROUNDS - 1}) AS n",
    )
    url = through(postgres_only_url, pgbouncer)
    settings = make_settings(database_url=url, count_first_deliveries=True)
    consumer = MemoryBroker().connect()

    def delivery(message_id: str) -> Delivery:
        return Delivery(message_id, "T", b"{}", {}, 1, consumer, None)

    async with engine_for(url, pool_size=16) as engine:

        async def count_and_refund(n: int) -> bool:
            counted = attempts.count(engine, delivery(f"c-{n}"), "c", settings)
            refunded = attempts.refund(engine, delivery(f"r-{n}"), "c")
            stored, _ = await asyncio.gather(counted, refunded)
            return stored

        async def prepare_then_execute(n: int) -> bool:
            async with engine.connect() as connection:
                autocommit = await connection.execution_options(isolation_level="AUTOCOMMIT")
                await autocommit.exec_driver_sql(f"PREPARE control_{n} AS SELECT 1")
                try:
                    await autocommit.exec_driver_sql(f"EXECUTE control_{n}")
                except DBAPIError:
                    return False
                return True

        stored = await asyncio.gather(*(count_and_refund(n) for n in range(ROUNDS)))
        control = await asyncio.gather(*(prepare_then_execute(n) for n in range(ROUNDS)))
    assert control.count(False) > 0, "the control never changed server connections"
    assert all(stored), f"{stored.count(False)} of {ROUNDS} counts not stored"
    rows = await fetch(postgres_only_url, "SELECT message_id, deliveries FROM delivery_counts")
    assert dict(rows) == {
        **{f"c-{n}": 1 for n in range(ROUNDS)},
        **{f"r-{n}": 4 for n in range(ROUNDS)},
    }
