"""Handlers that are wrong on purpose, each as a handler author could write it, and the fix
next to each: tests/testing/test_the_checker_names_each_mistake.py asserts that the checker
names the mistake, and passes the fix.

Each pair has a registry of its own (never the default one, which other tests serve), and
the models live on a declarative base of this module's own, so that worker.Base's metadata
(which the migrations' autogenerate reads) never sees them: the check is given
``models=[Base.metadata]``.

1. ``ESCAPING``: the credit's audit row goes through an engine of its own, "so that it
   survives a failed credit": it commits on its own.
2. ``RACY``: a stock reservation reads the row and writes it back, with no version token.
3. ``CHARGING``: a card charge over HTTP from an ordinary (transaction) handler, outside a
   claim: a rollback or a redelivery charges again.
4. ``RENAMING``: an upsert of an absolute value, rightly without the inbox, that announces
   the change with an outbox row of its own whose id is a new ``uuid4()`` on every attempt.
5. ``FORGETFUL``: a credit that remembers, per connection pool, the messages it handled, and
   skips them: memory that outlives a rollback, so a crash loses the credit.

tests/testing/evaluation.py has many more, and their fixes.
"""

from __future__ import annotations

import json
import uuid
import weakref
from decimal import Decimal

import httpx
from pydantic import BaseModel, ConfigDict
from sqlalchemy import Integer, MetaData, Numeric, String, insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from worker import ClaimContext, Context, Registry, insert_ignoring_conflicts, side_effect
from worker.outbox.model import OutboxMessage


class Base(DeclarativeBase):
    metadata = MetaData()


class Wallet(Base):
    __tablename__ = "wrong_wallets"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    balance: Mapped[Decimal] = mapped_column(Numeric(18, 2))
    version: Mapped[int] = mapped_column(Integer, nullable=False)

    __mapper_args__ = {"version_id_col": version}


class AuditEntry(Base):
    __tablename__ = "wrong_audit"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    credit_id: Mapped[str] = mapped_column(String(255))
    wallet_id: Mapped[str] = mapped_column(String(64))
    amount: Mapped[Decimal] = mapped_column(Numeric(18, 2))


class Stock(Base):
    """No version token: the mistake of ``RACY``."""

    __tablename__ = "wrong_stock"

    sku: Mapped[str] = mapped_column(String(64), primary_key=True)
    available: Mapped[int] = mapped_column(Integer)


class GuardedStock(Base):
    __tablename__ = "wrong_guarded_stock"

    sku: Mapped[str] = mapped_column(String(64), primary_key=True)
    available: Mapped[int] = mapped_column(Integer)
    version: Mapped[int] = mapped_column(Integer, nullable=False)

    __mapper_args__ = {"version_id_col": version}


class Payment(Base):
    __tablename__ = "wrong_payments"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    card: Mapped[str] = mapped_column(String(64))
    amount: Mapped[Decimal] = mapped_column(Numeric(18, 2))


class Profile(Base):
    __tablename__ = "wrong_profiles"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))


class Credit(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    wallet_id: str
    amount: Decimal


class Reservation(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    sku: str
    quantity: int


class Charge(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    card: str
    amount: Decimal


class Rename(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    profile_id: str
    name: str


async def credit_wallet(ctx: Context, message: Credit) -> None:
    wallet = await ctx.session.get(Wallet, message.wallet_id)
    if wallet is None:
        row = {"id": message.wallet_id, "balance": Decimal(0), "version": 1}
        await ctx.session.execute(insert_ignoring_conflicts(ctx.session, Wallet).values(row))
        wallet = await ctx.session.get_one(Wallet, message.wallet_id)
    wallet.balance += message.amount


def audit_row(ctx: Context, message: Credit) -> dict[str, object]:
    return {"credit_id": ctx.message_id, "wallet_id": message.wallet_id, "amount": message.amount}


# -- 1. a write through a second engine ----------------------------------------------------

ESCAPING = Registry()
_audit_engines: dict[str, AsyncEngine] = {}


def _audit_engine(ctx: Context) -> AsyncEngine:
    """The audit log's own engine, on the same database as the worker's."""
    bind = ctx.session.get_bind()
    engine = bind if isinstance(bind, Engine) else bind.engine
    url = engine.url.render_as_string(hide_password=False)
    if url not in _audit_engines:
        _audit_engines[url] = create_async_engine(url)
    return _audit_engines[url]


async def dispose_audit_engines() -> None:
    for engine in _audit_engines.values():
        await engine.dispose()
    _audit_engines.clear()


@ESCAPING.handler("WalletCredited", Credit, consumer="audited-credit")
async def audited_credit(ctx: Context, message: Credit) -> None:
    await credit_wallet(ctx, message)
    # WRONG: "the audit row must survive a failed credit", so it commits on its own
    async with _audit_engine(ctx).begin() as connection:
        await connection.execute(insert(AuditEntry).values(audit_row(ctx, message)))


AUDIT_DATABASE = {"url": ""}
"""Where ESCAPING_ELSEWHERE keeps its audit log: a database of its own, the test's."""

ESCAPING_ELSEWHERE = Registry()


@ESCAPING_ELSEWHERE.handler("WalletCredited", Credit, consumer="audited-credit")
async def audited_credit_elsewhere(ctx: Context, message: Credit) -> None:
    await credit_wallet(ctx, message)
    # WRONG as well: in a database of its own, it commits on its own too
    url = AUDIT_DATABASE["url"]
    if url not in _audit_engines:
        _audit_engines[url] = create_async_engine(url)
    async with _audit_engines[url].begin() as connection:
        await connection.execute(insert(AuditEntry).values(audit_row(ctx, message)))


ESCAPING_FIXED = Registry()


@ESCAPING_FIXED.handler("WalletCredited", Credit, consumer="audited-credit")
async def audited_credit_fixed(ctx: Context, message: Credit) -> None:
    await credit_wallet(ctx, message)
    await ctx.session.execute(insert(AuditEntry).values(audit_row(ctx, message)))


# -- 2. a read-modify-write without a version token -----------------------------------------

RACY = Registry()


@RACY.handler("StockReserved", Reservation, consumer="reserve-stock")
async def reserve(ctx: Context, message: Reservation) -> None:
    item = await ctx.session.get_one(Stock, message.sku)
    item.available -= message.quantity  # WRONG: no version token guards this write


RACY_FIXED = Registry()


@RACY_FIXED.handler("StockReserved", Reservation, consumer="reserve-stock")
async def reserve_fixed(ctx: Context, message: Reservation) -> None:
    item = await ctx.session.get_one(GuardedStock, message.sku)
    item.available -= message.quantity


RACY_LOCKED = Registry()


@RACY_LOCKED.handler("StockReserved", Reservation, consumer="reserve-stock")
async def reserve_locked(ctx: Context, message: Reservation) -> None:
    """The other fix: no token, but the row is locked from the read to the commit."""
    query = select(Stock).where(Stock.sku == message.sku).with_for_update()
    item = (await ctx.session.scalars(query)).one()
    item.available -= message.quantity


# -- 3. an HTTP call outside a claim --------------------------------------------------------

PAYMENTS = {"url": ""}
"""Where the payment API listens: the test sets it."""

CHARGING = Registry()


@CHARGING.handler("ChargeCard", Charge, consumer="charge-card")
async def charge(ctx: Context, message: Charge) -> None:
    # WRONG: the charge is made inside the transaction; a rollback or a redelivery repeats it
    async with httpx.AsyncClient(timeout=5.0) as client:
        answer = await client.post(
            PAYMENTS["url"], json={"card": message.card, "amount": str(message.amount)}
        )
        answer.raise_for_status()
    ctx.session.add(Payment(id=ctx.message_id, card=message.card, amount=message.amount))


CHARGING_FIXED = Registry()


@side_effect("ChargeCard", Charge, consumer="charge-card", registry=CHARGING_FIXED)
async def charge_fixed(ctx: ClaimContext, message: Charge) -> str:
    async with httpx.AsyncClient(timeout=ctx.time_left) as client:
        answer = await client.post(
            PAYMENTS["url"],
            json={"card": message.card, "amount": str(message.amount)},
            headers={"Idempotency-Key": ctx.idempotency_key},
        )
        answer.raise_for_status()
    ctx.session.add(Payment(id=ctx.message_id, card=message.card, amount=message.amount))
    return f"HTTP {answer.status_code}"


# -- 4. a new uuid4() for an outbox event on every attempt ----------------------------------

RENAMING = Registry()


async def _set_name(ctx: Context, message: Rename) -> None:
    """An upsert of an absolute value: idempotent by nature, so it needs no inbox."""
    dialect = postgresql if ctx.session.get_bind().dialect.name == "postgresql" else sqlite
    upsert = dialect.insert(Profile).values(id=message.profile_id, name=message.name)
    await ctx.session.execute(
        upsert.on_conflict_do_update(index_elements=["id"], set_={"name": message.name})
    )


@RENAMING.handler("ProfileRenamed", Rename, consumer="rename-profile", inbox=False)
async def rename(ctx: Context, message: Rename) -> None:
    await _set_name(ctx, message)
    # WRONG: the event's id is new on every attempt, so its conflict clause never fires
    event = {
        "message_id": str(uuid.uuid4()),
        "message_type": "ProfileNameChanged",
        "body": json.dumps({"profile_id": message.profile_id, "name": message.name}).encode(),
        "source_message_id": ctx.message_id,
        "consumer": ctx.consumer,
    }
    await ctx.session.execute(insert_ignoring_conflicts(ctx.session, OutboxMessage).values(event))


RENAMING_FIXED = Registry()


@RENAMING_FIXED.handler("ProfileRenamed", Rename, consumer="rename-profile", inbox=False)
async def rename_fixed(ctx: Context, message: Rename) -> None:
    await _set_name(ctx, message)
    body = {"profile_id": message.profile_id, "name": message.name}
    await ctx.publish("ProfileNameChanged", body)  # its id is derived from the message's


# -- 5. memory that outlives a rollback ------------------------------------------------------

FORGETFUL = Registry()
_handled: weakref.WeakKeyDictionary[Engine, set[str]] = weakref.WeakKeyDictionary()


@FORGETFUL.handler("WalletCredited", Credit, consumer="credit-once")
async def credit_once_per_pool(ctx: Context, message: Credit) -> None:
    handled = _handled.setdefault(ctx.session.get_bind().engine, set())
    if ctx.message_id in handled:  # WRONG: remembered although the transaction may roll back
        return
    handled.add(ctx.message_id)
    await credit_wallet(ctx, message)
