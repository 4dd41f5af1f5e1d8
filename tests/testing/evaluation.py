"""The prover's evaluation set: handlers written the way handler authors write them, some
wrong in ways real developers are wrong, some right in ways that look suspicious, each
with the samples a user would give and, for the wrong ones, the causes that name the
mistake right. tests/testing/test_the_evaluation_set.py runs the checker over all of
them on SQLite and on PostgreSQL.

Each case has a registry of its own (never the default one); the models live on a
declarative base of this module's own (and wrong_handlers.py's), kept out of
``worker.Base``. The four mistakes of wrong_handlers.py and their fixes are cases too.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import aio_pika
import aiosqlite
import asyncpg
import httpx
from pydantic import BaseModel, ConfigDict
from sqlalchemy import (
    Boolean,
    DateTime,
    ForeignKey,
    Integer,
    MetaData,
    Numeric,
    String,
    bindparam,
    delete,
    func,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.orm.exc import StaleDataError

from handlers.credit import CreditRequested, apply_credit
from handlers.pricing import ChangeProductPrice, change_price
from tests.testing import evaluation_prices
from tests.testing import wrong_handlers as wrong
from tests.testing.wrong_handlers import PAYMENTS, AuditEntry, Charge, Credit, Payment, Wallet
from worker import (
    ClaimContext,
    Context,
    Registry,
    Rejected,
    insert_ignoring_conflicts,
    side_effect,
)
from worker.testing import (
    COMMITTED,
    ESCAPED,
    NEW_ID,
    NO_INBOX,
    NO_TOKEN,
    OUT_OF_ORDER,
    OUTSIDE_CLAIM,
    RACED,
    REPEATED_CALL,
    STATE,
    SWALLOWED,
    UNSTABLE,
    Sample,
)


class Base(DeclarativeBase):
    metadata = MetaData()


class Account(Base):
    """A balance without a version token."""

    __tablename__ = "ev_accounts"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    balance: Mapped[Decimal] = mapped_column(Numeric(18, 2))


class Customer(Base):
    __tablename__ = "ev_customers"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))


class Order(Base):
    __tablename__ = "ev_orders"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    customer_id: Mapped[str] = mapped_column(String(64))
    ref: Mapped[str] = mapped_column(String(255))


class Signup(Base):
    """No unique constraint on the address: the mistake of ``SIGNUP_CHECKED``."""

    __tablename__ = "ev_signups"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    email: Mapped[str] = mapped_column(String(320))


class Member(Base):
    __tablename__ = "ev_members"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    email: Mapped[str] = mapped_column(String(320), unique=True)


class Price(Base):
    __tablename__ = "ev_prices"

    sku: Mapped[str] = mapped_column(String(64), primary_key=True)
    price: Mapped[Decimal] = mapped_column(Numeric(18, 2))
    seq: Mapped[int] = mapped_column(Integer)


class Product(Base):
    __tablename__ = "ev_products"

    sku: Mapped[str] = mapped_column(String(64), primary_key=True)
    price: Mapped[Decimal] = mapped_column(Numeric(18, 2))


class OrderLine(Base):
    __tablename__ = "ev_order_lines"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    sku: Mapped[str] = mapped_column(String(64))
    quantity: Mapped[int] = mapped_column(Integer)
    total: Mapped[Decimal] = mapped_column(Numeric(18, 2))


class Notification(Base):
    __tablename__ = "ev_notifications"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    text: Mapped[str] = mapped_column(String(200))
    read: Mapped[bool] = mapped_column(Boolean, default=False)


class Invoice(Base):
    __tablename__ = "ev_invoices"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    customer_id: Mapped[str] = mapped_column(String(64))
    number: Mapped[int] = mapped_column(Integer)


class Tally(Base):
    __tablename__ = "ev_tallies"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    n: Mapped[int] = mapped_column(Integer)
    last: Mapped[str] = mapped_column(String(255), default="")


class Profile(Base):
    __tablename__ = "ev_profiles"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))


class Stock(Base):
    """A version column the handler compares itself (no ``version_id_col``)."""

    __tablename__ = "ev_stock"

    sku: Mapped[str] = mapped_column(String(64), primary_key=True)
    available: Mapped[int] = mapped_column(Integer)
    version: Mapped[int] = mapped_column(Integer)


class Shipment(Base):
    __tablename__ = "ev_shipments"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    order_ref: Mapped[str] = mapped_column(String(64))


class TaxedSale(Base):
    __tablename__ = "ev_taxed_sales"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    country: Mapped[str] = mapped_column(String(2))
    tax: Mapped[Decimal] = mapped_column(Numeric(18, 2))


class Ledger(Base):
    __tablename__ = "ev_ledger"

    message_id: Mapped[str] = mapped_column(String(255), primary_key=True)


class Shopper(Base):
    __tablename__ = "ev_shoppers"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    baskets: Mapped[int] = mapped_column(Integer)
    version: Mapped[int] = mapped_column(Integer)

    __mapper_args__ = {"version_id_col": version}


class Basket(Base):
    __tablename__ = "ev_baskets"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    shopper_id: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    items: Mapped[list[BasketItem]] = relationship(cascade="all, delete-orphan")


class BasketItem(Base):
    __tablename__ = "ev_basket_items"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    basket_id: Mapped[int] = mapped_column(ForeignKey("ev_baskets.id", ondelete="CASCADE"))
    sku: Mapped[str] = mapped_column(String(64))


class Converted(Base):
    __tablename__ = "ev_converted"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    eur: Mapped[Decimal] = mapped_column(Numeric(18, 2))
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))  # written by the handler


# -- messages --------------------------------------------------------------------------


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Amount(_Message):
    account_id: str
    amount: Decimal


class PlaceOrder(_Message):
    customer_id: str


class SignUp(_Message):
    email: str


class SetPrice(_Message):
    sku: str
    price: Decimal
    seq: int


class PriceProduct(_Message):
    sku: str
    price: Decimal


class OrderItem(_Message):
    sku: str
    quantity: int


class MarkRead(_Message):
    notification_id: str


class IssueInvoice(_Message):
    customer_id: str


class Tick(_Message):
    tally_id: str


class SetName(_Message):
    profile_id: str
    name: str


class Reserve(_Message):
    sku: str
    quantity: int


class Ship(_Message):
    order_ref: str


class Sale(_Message):
    country: str
    amount: Decimal


class Cancel(_Message):
    order_id: int


class Fill(_Message):
    shopper_id: str
    skus: list[str]


class Register(_Message):
    customer_id: str
    name: str


def _dialect(ctx: Context) -> Any:
    return postgresql if ctx.session.get_bind().dialect.name == "postgresql" else sqlite


# -- writes past the transaction ---------------------------------------------------------

RAW_CONNECTION = Registry()


@RAW_CONNECTION.handler("WalletCredited", Credit, consumer="audited-credit")
async def audited_credit_raw(ctx: Context, message: Credit) -> None:
    await wrong.credit_wallet(ctx, message)
    # WRONG: "the audit log must survive a failed credit": a driver connection of its own
    url = ctx.session.get_bind().engine.url
    row = (ctx.message_id, message.wallet_id)
    if url.get_backend_name() == "sqlite":
        async with aiosqlite.connect(str(url.database)) as db:
            await db.execute(
                "INSERT INTO wrong_audit (credit_id, wallet_id, amount) VALUES (?, ?, ?)",
                (*row, str(message.amount)),
            )
            await db.commit()
        return
    connection = await asyncpg.connect(
        user=url.username, host=url.host, port=url.port, database=url.database
    )
    try:
        await connection.execute(
            "INSERT INTO wrong_audit (credit_id, wallet_id, amount) VALUES ($1, $2, $3)",
            *row,
            message.amount,
        )
    finally:
        await connection.close()


OWN_SESSION = Registry()


@OWN_SESSION.handler("WalletCredited", Credit, consumer="audited-credit")
async def audited_credit_own_session(ctx: Context, message: Credit) -> None:
    await wrong.credit_wallet(ctx, message)
    # WRONG: a session of its own on the worker's engine: another connection, its own commit
    async with AsyncSession(ctx.session.bind) as own:
        own.add(AuditEntry(**wrong.audit_row(ctx, message)))
        await own.commit()


COMMITS = Registry()


@COMMITS.handler("WalletCredited", Credit, consumer="audited-credit")
async def credit_and_commit(ctx: Context, message: Credit) -> None:
    await wrong.credit_wallet(ctx, message)
    await ctx.session.commit()  # WRONG: "make sure the credit is saved before the audit"
    ctx.session.add(AuditEntry(**wrong.audit_row(ctx, message)))


COMMIT_STATEMENT = Registry()


@COMMIT_STATEMENT.handler("WalletCredited", Credit, consumer="audited-credit")
async def credit_and_commit_sql(ctx: Context, message: Credit) -> None:
    await wrong.credit_wallet(ctx, message)
    await ctx.session.flush()
    await ctx.session.execute(text("COMMIT"))  # WRONG: the same, past the session's guard
    ctx.session.add(AuditEntry(**wrong.audit_row(ctx, message)))


SWALLOWING = Registry()


@SWALLOWING.handler("CustomerRegistered", Register, consumer="register-customer")
async def register(ctx: Context, message: Register) -> None:
    try:
        ctx.session.add(Customer(id=message.customer_id, name=message.name))
        await ctx.session.flush()
    except IntegrityError:
        return  # WRONG: "already registered, nothing to do": the transaction is spoilt


SAVEPOINT = Registry()


@SAVEPOINT.handler("CustomerRegistered", Register, consumer="register-customer")
async def register_fixed(ctx: Context, message: Register) -> None:
    try:
        async with ctx.session.begin_nested():
            ctx.session.add(Customer(id=message.customer_id, name=message.name))
    except IntegrityError:  # undone by its savepoint: the transaction goes on
        customer = await ctx.session.get_one(Customer, message.customer_id)
        customer.name = message.name


# -- lost updates and write skew ---------------------------------------------------------

RAW_SQL = Registry()
_BALANCE = text("SELECT balance FROM ev_accounts WHERE id = :id").columns(balance=Numeric(18, 2))
_SET_BALANCE = text("UPDATE ev_accounts SET balance = :balance WHERE id = :id").bindparams(
    bindparam("balance", type_=Numeric(18, 2))
)


@RAW_SQL.handler("Deposited", Amount, consumer="deposit")
async def deposit_raw(ctx: Context, message: Amount) -> None:
    found = await ctx.session.execute(_BALANCE, {"id": message.account_id})
    balance = found.scalar_one()
    await ctx.session.execute(  # WRONG: the balance read above, written back by its key
        _SET_BALANCE, {"balance": balance + message.amount, "id": message.account_id}
    )


CHECKED_WITHDRAWAL = Registry()


@CHECKED_WITHDRAWAL.handler("Withdrawn", Amount, consumer="withdraw")
async def withdraw(ctx: Context, message: Amount) -> None:
    query = select(Account.balance).where(Account.id == message.account_id)
    balance = await ctx.session.scalar(query)
    if balance is None or balance < message.amount:
        raise Rejected("insufficient funds", subject=f"ev_accounts:{message.account_id}")
    # WRONG: the check above may no longer hold when this runs
    await ctx.session.execute(
        update(Account)
        .where(Account.id == message.account_id)
        .values(balance=Account.balance - message.amount)
    )


GUARDED_WITHDRAWAL = Registry()


@GUARDED_WITHDRAWAL.handler("Withdrawn", Amount, consumer="withdraw")
async def withdraw_guarded(ctx: Context, message: Amount) -> None:
    result = await ctx.session.execute(
        update(Account)
        .where(Account.id == message.account_id, Account.balance >= message.amount)
        .values(balance=Account.balance - message.amount)
    )
    if result.rowcount == 0:  # type: ignore[attr-defined]
        raise Rejected("insufficient funds", subject=f"ev_accounts:{message.account_id}")


ORDER_LIMIT = Registry()
_LIMIT = 1  # open orders per customer


@ORDER_LIMIT.handler("OrderPlaced", PlaceOrder, consumer="place-order")
async def place_order(ctx: Context, message: PlaceOrder) -> None:
    count = select(func.count()).select_from(Order).where(Order.customer_id == message.customer_id)
    if (await ctx.session.scalar(count) or 0) >= _LIMIT:
        raise Rejected("order limit reached", subject=f"ev_customers:{message.customer_id}")
    ctx.session.add(Order(customer_id=message.customer_id, ref=ctx.message_id))  # WRONG


LOCKED_ORDER_LIMIT = Registry()


@LOCKED_ORDER_LIMIT.handler("OrderPlaced", PlaceOrder, consumer="place-order")
async def place_order_locked(ctx: Context, message: PlaceOrder) -> None:
    # every writer of a customer's orders locks the customer first: they queue there
    owner = select(Customer).where(Customer.id == message.customer_id).with_for_update()
    (await ctx.session.scalars(owner)).one()
    count = select(func.count()).select_from(Order).where(Order.customer_id == message.customer_id)
    if (await ctx.session.scalar(count) or 0) >= _LIMIT:
        raise Rejected("order limit reached", subject=f"ev_customers:{message.customer_id}")
    ctx.session.add(Order(customer_id=message.customer_id, ref=ctx.message_id))


SIGNUP_CHECKED = Registry()


@SIGNUP_CHECKED.handler("SignedUp", SignUp, consumer="sign-up")
async def sign_up(ctx: Context, message: SignUp) -> None:
    taken = await ctx.session.scalar(select(Signup.id).where(Signup.email == message.email))
    if taken is None:
        ctx.session.add(Signup(email=message.email))  # WRONG: nothing stops a second one


SIGNUP_UNIQUE = Registry()


@SIGNUP_UNIQUE.handler("SignedUp", SignUp, consumer="sign-up")
async def sign_up_unique(ctx: Context, message: SignUp) -> None:
    statement = insert_ignoring_conflicts(ctx.session, Member).values(email=message.email)
    await ctx.session.execute(statement)


VERSION_CHECKED = Registry()


@VERSION_CHECKED.handler("StockReserved", Reserve, consumer="reserve-stock")
async def reserve_checked(ctx: Context, message: Reserve) -> None:
    query = select(Stock.available, Stock.version).where(Stock.sku == message.sku)
    seen = (await ctx.session.execute(query)).one()
    changed = await ctx.session.execute(
        update(Stock)
        .where(Stock.sku == message.sku, Stock.version == seen.version)
        .values(available=seen.available - message.quantity, version=seen.version + 1)
    )
    if changed.rowcount != 1:  # type: ignore[attr-defined]
        raise StaleDataError("the stock changed since it was read")  # the pump retries


BLIND_WRITE = Registry()


@BLIND_WRITE.handler("NotificationRead", MarkRead, consumer="mark-read")
async def mark_read(ctx: Context, message: MarkRead) -> None:
    await ctx.session.get_one(Notification, message.notification_id)  # it must exist
    await ctx.session.execute(
        update(Notification).where(Notification.id == message.notification_id).values(read=True)
    )


# -- state in memory ---------------------------------------------------------------------

PRICE_CACHE = Registry()
_PRICES: dict[str, str] = {}


@PRICE_CACHE.handler("ProductPriced", PriceProduct, consumer="price-product")
async def price_product(ctx: Context, message: PriceProduct) -> None:
    await ctx.session.execute(
        update(Product).where(Product.sku == message.sku).values(price=message.price)
    )
    _PRICES[message.sku] = str(message.price)


@PRICE_CACHE.handler("ItemOrdered", OrderItem, consumer="order-item")
async def order_item(ctx: Context, message: OrderItem) -> None:
    price = _PRICES.get(message.sku)  # WRONG: what this process saw last, not the row
    if price is None:
        found = await ctx.session.scalar(select(Product.price).where(Product.sku == message.sku))
        price = _PRICES[message.sku] = str(found)
    total = Decimal(price) * message.quantity
    ctx.session.add(
        OrderLine(id=ctx.message_id, sku=message.sku, quantity=message.quantity, total=total)
    )


SEEN_IDS = Registry()
_SEEN: set[str] = set()


@SEEN_IDS.handler("WalletCredited", Credit, consumer="credit-once")
async def credit_once(ctx: Context, message: Credit) -> None:
    if ctx.message_id in _SEEN:  # WRONG: "the inbox is slow, skip what we saw"
        return
    _SEEN.add(ctx.message_id)
    wallet = await ctx.session.get_one(Wallet, message.wallet_id)
    wallet.balance += message.amount


INVOICE_NUMBERS = Registry()
_NUMBERS = itertools.count(1)


@INVOICE_NUMBERS.handler("InvoiceIssued", IssueInvoice, consumer="issue-invoice")
async def issue_invoice(ctx: Context, message: IssueInvoice) -> None:
    number = next(_NUMBERS)  # WRONG: a sequence that lives in this process
    ctx.session.add(Invoice(id=ctx.message_id, customer_id=message.customer_id, number=number))


HELPER_CACHE = Registry()


@HELPER_CACHE.handler("ProductPriced", PriceProduct, consumer="price-product")
async def price_product_remembered(ctx: Context, message: PriceProduct) -> None:
    await ctx.session.execute(
        update(Product).where(Product.sku == message.sku).values(price=message.price)
    )
    evaluation_prices.remember(message.sku, str(message.price))


@HELPER_CACHE.handler("ItemOrdered", OrderItem, consumer="order-item")
async def order_item_remembered(ctx: Context, message: OrderItem) -> None:
    price = evaluation_prices.PRICES.get(message.sku)  # WRONG: the same cache, elsewhere
    if price is None:
        found = await ctx.session.scalar(select(Product.price).where(Product.sku == message.sku))
        price = str(found)
        evaluation_prices.remember(message.sku, price)
    total = Decimal(price) * message.quantity
    line = OrderLine(id=ctx.message_id, sku=message.sku, quantity=message.quantity, total=total)
    ctx.session.add(line)


class _Seen:
    ids: set[str] = set()  # a class attribute: no copy of the module reaches it


def forget() -> None:
    """What a new process would start from: the class attribute's ids, gone. (A check run
    twice in one process would otherwise begin where the first left it.)"""
    _Seen.ids.clear()


CLASS_SEEN = Registry()


@CLASS_SEEN.handler("Ticked", Tick, consumer="tick-once")
async def tick_once(ctx: Context, message: Tick) -> None:
    if ctx.message_id in _Seen.ids:  # WRONG: "skip what this process did already"
        return
    _Seen.ids.add(ctx.message_id)
    await ctx.session.execute(
        update(Tally).where(Tally.id == message.tally_id).values(n=Tally.n + 1)
    )


LAST_ID = Registry()


@LAST_ID.handler("Ticked", Tick, consumer="tick", inbox=False)
async def tick_unless_last(ctx: Context, message: Tick) -> None:
    tally = await ctx.session.get_one(Tally, message.tally_id)
    if tally.last == ctx.message_id:  # WRONG: "a duplicate": only one right after
        return
    await ctx.session.execute(
        update(Tally).where(Tally.id == message.tally_id).values(n=Tally.n + 1, last=ctx.message_id)
    )


LEDGER = Registry()


@LEDGER.handler("Ticked", Tick, consumer="tick", inbox=False)
async def tick_with_ledger(ctx: Context, message: Tick) -> None:
    """An inbox of its own: a ledger row per message id, in the same transaction."""
    mark = _dialect(ctx).insert(Ledger).values(message_id=ctx.message_id)
    marked = await ctx.session.execute(mark.on_conflict_do_nothing())
    if marked.rowcount == 1:  # type: ignore[attr-defined]
        await ctx.session.execute(
            update(Tally).where(Tally.id == message.tally_id).values(n=Tally.n + 1)
        )


CANCEL = Registry()


@CANCEL.handler("OrderCancelled", Cancel, consumer="cancel-order")
async def cancel_order(ctx: Context, message: Cancel) -> None:
    order = await ctx.session.get(Basket, message.order_id)
    if order is None:
        return  # gone already
    if order.status == "shipped":
        raise Rejected("already shipped", subject=f"ev_baskets:{message.order_id}")
    await ctx.session.execute(delete(Basket).where(Basket.id == message.order_id))


PARENT_CHILD = Registry()


@PARENT_CHILD.handler("BasketFilled", Fill, consumer="fill-basket")
async def fill_basket(ctx: Context, message: Fill) -> None:
    owner = await ctx.session.get_one(Shopper, message.shopper_id)  # versioned
    owner.baskets += 1
    items = [BasketItem(sku=sku) for sku in message.skus]
    ctx.session.add(Basket(shopper_id=message.shopper_id, status="open", items=items))


RATES = Registry()


def _rate_api(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"rate": "0.50"})


_rates = httpx.AsyncClient(transport=httpx.MockTransport(_rate_api))


@RATES.handler("PaymentReceived", Amount, consumer="convert-payment")
async def convert_payment(ctx: Context, message: Amount) -> None:
    rate = Decimal((await _rates.get("http://rates.example/usd-eur")).json()["rate"])
    ctx.session.add(Converted(id=ctx.message_id, eur=message.amount * rate, at=datetime.now(UTC)))


CONFIG_CACHE = Registry()
_RATES: dict[str, str] = {}
_DEFAULT_RATES = {"DE": "0.19", "FR": "0.20"}


def _rate(country: str) -> Decimal:
    if not _RATES:  # loaded once, never changed: a cache of constants
        _RATES.update(_DEFAULT_RATES)
    return Decimal(_RATES[country])


@CONFIG_CACHE.handler("SaleMade", Sale, consumer="tax-sale")
async def tax_sale(ctx: Context, message: Sale) -> None:
    tax = (message.amount * _rate(message.country)).quantize(Decimal("0.01"))
    ctx.session.add(TaxedSale(id=ctx.message_id, country=message.country, tax=tax))


# -- calls to the outside ----------------------------------------------------------------

_client: httpx.AsyncClient | None = None


def _payments() -> httpx.AsyncClient:
    """One client for every message, kept open: a connection reused across messages."""
    global _client
    if _client is None:
        _client = httpx.AsyncClient(timeout=5.0)
    return _client


async def close_clients() -> None:
    global _client, _amqp, _channel
    if _client is not None:
        await _client.aclose()
        _client = None
    if _amqp is not None:
        await _amqp.close()
        _amqp = _channel = None


MODULE_CLIENT = Registry()


@MODULE_CLIENT.handler("ChargeCard", Charge, consumer="charge-card")
async def charge_with_module_client(ctx: Context, message: Charge) -> None:
    # WRONG: a charge inside the transaction; the client is opened once, so no new
    # connection shows the repeated call
    answer = await _payments().post(
        PAYMENTS["url"], json={"card": message.card, "amount": str(message.amount)}
    )
    answer.raise_for_status()
    ctx.session.add(Payment(id=ctx.message_id, card=message.card, amount=message.amount))


MODULE_CLIENT_CLAIM = Registry()


@side_effect("ChargeCard", Charge, consumer="charge-card", registry=MODULE_CLIENT_CLAIM)
async def charge_with_module_client_fixed(ctx: ClaimContext, message: Charge) -> str:
    answer = await _payments().post(
        PAYMENTS["url"],
        json={"card": message.card, "amount": str(message.amount)},
        headers={"Idempotency-Key": ctx.idempotency_key},
    )
    answer.raise_for_status()
    return f"HTTP {answer.status_code}"


CLAIM_RANDOM_KEY = Registry()


@side_effect("ChargeCard", Charge, consumer="charge-card", registry=CLAIM_RANDOM_KEY)
async def charge_random_key(ctx: ClaimContext, message: Charge) -> str:
    async with httpx.AsyncClient(timeout=ctx.time_left) as client:
        answer = await client.post(
            PAYMENTS["url"],
            json={"card": message.card, "amount": str(message.amount)},
            headers={"Idempotency-Key": str(uuid.uuid4())},  # WRONG: new on every call
        )
    answer.raise_for_status()
    return f"HTTP {answer.status_code}"


CLAIM_NO_KEY = Registry()


@side_effect("ChargeCard", Charge, consumer="charge-card", registry=CLAIM_NO_KEY)
async def charge_without_key(ctx: ClaimContext, message: Charge) -> str:
    async with httpx.AsyncClient(timeout=ctx.time_left) as client:
        answer = await client.post(  # WRONG: no key, so a repeated call charges again
            PAYMENTS["url"], json={"card": message.card, "amount": str(message.amount)}
        )
    answer.raise_for_status()
    return f"HTTP {answer.status_code}"


CLAIM_KEY_IN_BODY = Registry()


@side_effect("ChargeCard", Charge, consumer="charge-card", registry=CLAIM_KEY_IN_BODY)
async def charge_key_in_body(ctx: ClaimContext, message: Charge) -> str:
    """A provider that takes its idempotency key in the request's body."""
    payload = {"card": message.card, "amount": str(message.amount), "key": ctx.idempotency_key}
    async with httpx.AsyncClient(timeout=ctx.time_left) as client:
        answer = await client.post(PAYMENTS["url"], json=payload)
    answer.raise_for_status()
    return f"HTTP {answer.status_code}"


AMQP = {"url": "amqp://guest:guest@127.0.0.1:5672/", "queue": "worker-testing-evaluation"}
_amqp: aio_pika.abc.AbstractRobustConnection | None = None
_channel: aio_pika.abc.AbstractChannel | None = None


async def _announcements() -> aio_pika.abc.AbstractChannel:
    global _amqp, _channel
    if _channel is None:
        _amqp = await aio_pika.connect_robust(AMQP["url"])
        _channel = await _amqp.channel()
    return _channel


MODULE_BROKER = Registry()


@MODULE_BROKER.handler("OrderShipped", Ship, consumer="ship-order")
async def ship(ctx: Context, message: Ship) -> None:
    ctx.session.add(Shipment(id=ctx.message_id, order_ref=message.order_ref))
    channel = await _announcements()
    # WRONG: published from inside the transaction, on a channel kept open across messages
    await channel.default_exchange.publish(
        aio_pika.Message(body=message.model_dump_json().encode(), message_id=ctx.message_id),
        routing_key=AMQP["queue"],
    )


# -- order -------------------------------------------------------------------------------

UNSEQUENCED_PRICE = Registry()


def _upsert_price(ctx: Context, message: SetPrice) -> Any:
    row = {"sku": message.sku, "price": message.price, "seq": message.seq}
    return _dialect(ctx).insert(Price).values(row)


@UNSEQUENCED_PRICE.handler("PriceSet", SetPrice, consumer="set-price")
async def set_price(ctx: Context, message: SetPrice) -> None:
    upsert = _upsert_price(ctx, message)
    changed = {"price": upsert.excluded.price, "seq": upsert.excluded.seq}
    # WRONG: the newest write wins, not the newest price
    await ctx.session.execute(upsert.on_conflict_do_update(index_elements=["sku"], set_=changed))


SEQUENCED_PRICE = Registry()


@SEQUENCED_PRICE.handler("PriceSet", SetPrice, consumer="set-price", inbox=False)
async def set_price_sequenced(ctx: Context, message: SetPrice) -> None:
    upsert = _upsert_price(ctx, message)
    changed = {"price": upsert.excluded.price, "seq": upsert.excluded.seq}
    await ctx.session.execute(
        upsert.on_conflict_do_update(
            index_elements=["sku"], set_=changed, where=Price.seq < upsert.excluded.seq
        )
    )


NO_INBOX_NAME = Registry()


@NO_INBOX_NAME.handler("NameSet", SetName, consumer="set-name", inbox=False)
async def set_name(ctx: Context, message: SetName) -> None:
    upsert = _dialect(ctx).insert(Profile).values(id=message.profile_id, name=message.name)
    # WRONG: idempotent for a duplicate at once, not for one that arrives after a newer name
    await ctx.session.execute(
        upsert.on_conflict_do_update(index_elements=["id"], set_={"name": message.name})
    )


NO_INBOX_TALLY = Registry()


@NO_INBOX_TALLY.handler("Ticked", Tick, consumer="tick", inbox=False)
async def tick(ctx: Context, message: Tick) -> None:
    await ctx.session.execute(  # WRONG: an increment is no upsert of an absolute value
        update(Tally).where(Tally.id == message.tally_id).values(n=Tally.n + 1)
    )


# -- the shipped handlers, in registries of their own --------------------------------------

SHIPPED_CREDIT = Registry()
SHIPPED_CREDIT.handler(
    "CreditRequested", CreditRequested, consumer="credit", key=lambda m: m.account_id
)(apply_credit)
SHIPPED_PRICING = Registry()
SHIPPED_PRICING.handler("ChangeProductPrice", ChangeProductPrice, consumer="pricing")(change_price)


# -- the cases ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Case:
    """One handler of the set: what it is, its samples, and the causes that name it right
    (empty: it is correct, and must pass)."""

    name: str
    kind: str
    handlers: Registry
    samples: Sequence[Sample]
    causes: frozenset[str] = frozenset()
    given: Sequence[tuple[str, dict[str, Any]]] = ()
    needs: frozenset[str] = frozenset()  # "payments", "rabbitmq"
    default: frozenset[str] = frozenset()  # the databases it runs on in the default suite

    @property
    def wrong(self) -> bool:
        return bool(self.causes)


def _credits(n: int = 2) -> list[Sample]:
    amounts = ["5.00", "1.25", "2.50"]
    return [Sample("WalletCredited", {"wallet_id": "w-1", "amount": a}) for a in amounts[:n]]


_WALLET = [("wrong_wallets", {"id": "w-1", "balance": "0.00", "version": 1})]
_STOCK = [
    ("wrong_stock", {"sku": "s-1", "available": 10}),
    ("wrong_guarded_stock", {"sku": "s-1", "available": 10, "version": 1}),
]
_RESERVATIONS = [
    Sample("StockReserved", {"sku": "s-1", "quantity": 2}),
    Sample("StockReserved", {"sku": "s-1", "quantity": 3}),
]
_CHARGE = [Sample("ChargeCard", {"card": "c-1", "amount": "9.99"})]
_ACCOUNT = [("ev_accounts", {"id": "a-1", "balance": "100.00"})]
_WITHDRAWALS = [
    Sample("Withdrawn", {"account_id": "a-1", "amount": "60.00"}),
    Sample("Withdrawn", {"account_id": "a-1", "amount": "50.00"}),
]
_ORDERS = [Sample("OrderPlaced", {"customer_id": "c-1"}) for _ in range(2)]
_REGISTRATIONS = [
    Sample("CustomerRegistered", {"customer_id": "c-1", "name": "Ada"}),
    Sample("CustomerRegistered", {"customer_id": "c-1", "name": "Ada L."}),
]
_PRICES_SET = [
    Sample("PriceSet", {"sku": "p-1", "price": "10.00", "seq": 1}),
    Sample("PriceSet", {"sku": "p-1", "price": "12.00", "seq": 2}),
]
_P = "payments"
SQLITE = frozenset({"sqlite"})
BOTH = frozenset({"sqlite", "postgresql"})  # where the databases behave differently
_TICKS = [Sample("Ticked", {"tally_id": "t-1"}, id=f"tick-{n}") for n in (1, 2)]
_TALLY = [("ev_tallies", {"id": "t-1", "n": 0, "last": ""})]

CASES: tuple[Case, ...] = (
    # writes past the transaction
    Case("second engine", "write through a second engine", wrong.ESCAPING, _credits(),
         frozenset({ESCAPED}), _WALLET),
    Case("raw driver connection", "write through a raw driver connection", RAW_CONNECTION,
         _credits(), frozenset({ESCAPED}), _WALLET, default=BOTH),
    Case("own session on the engine", "write through a second connection", OWN_SESSION,
         _credits(), frozenset({ESCAPED}), _WALLET),
    Case("commit inside", "commit inside the handler", COMMITS, _credits(),
         frozenset({COMMITTED}), _WALLET),
    Case("COMMIT statement", "commit inside the handler", COMMIT_STATEMENT, _credits(),
         frozenset({COMMITTED}), _WALLET, default=BOTH),
    Case("swallowed integrity error", "swallowed database error", SWALLOWING, _REGISTRATIONS,
         frozenset({SWALLOWED})),
    Case("audit through the session", "(fix) writes through ctx.session", wrong.ESCAPING_FIXED,
         _credits(), given=_WALLET),
    Case("savepoint upsert", "(fix) a caught error inside a savepoint", SAVEPOINT,
         _REGISTRATIONS),
    # lost updates, write skew
    Case("read-modify-write", "lost update without a token", wrong.RACY, _RESERVATIONS,
         frozenset({NO_TOKEN}), _STOCK),
    Case("raw SQL read-modify-write", "lost update without a token", RAW_SQL,
         [Sample("Deposited", {"account_id": "a-1", "amount": a}) for a in ("5.00", "7.00")],
         frozenset({NO_TOKEN}), _ACCOUNT),
    Case("checked withdrawal", "write skew: two withdrawals through a check",
         CHECKED_WITHDRAWAL, _WITHDRAWALS, frozenset({RACED}), _ACCOUNT, default=BOTH),
    Case("order limit", "write skew: count, then insert under a limit", ORDER_LIMIT, _ORDERS,
         frozenset({RACED}), [("ev_customers", {"id": "c-1", "name": "Ada"})],
         default=frozenset({"postgresql"})),
    Case("sign-up check", "write skew: exists, then insert", SIGNUP_CHECKED,
         [Sample("SignedUp", {"email": "ada@example.com"}) for _ in range(2)],
         frozenset({RACED})),
    Case("version token", "(fix) version_id_col", wrong.RACY_FIXED, _RESERVATIONS,
         given=_STOCK),
    Case("row lock", "(fix) SELECT ... FOR UPDATE", wrong.RACY_LOCKED, _RESERVATIONS,
         given=_STOCK),
    Case("explicit version check", "(fix) update().where(version == seen)", VERSION_CHECKED,
         _RESERVATIONS, given=[("ev_stock", {"sku": "s-1", "available": 10, "version": 1})],
         default=BOTH),
    Case("blind write after a read", "(fix) SET read = true WHERE id = :id", BLIND_WRITE,
         [Sample("NotificationRead", {"notification_id": n}) for n in ("n-1", "n-2", "n-1")],
         given=[("ev_notifications", {"id": n, "text": "hi", "read": False})
                for n in ("n-1", "n-2")], default=BOTH),
    Case("guarded withdrawal", "(fix) the check in the UPDATE's WHERE", GUARDED_WITHDRAWAL,
         _WITHDRAWALS, given=_ACCOUNT),
    Case("locked order limit", "(fix) the parent row locked", LOCKED_ORDER_LIMIT, _ORDERS,
         given=[("ev_customers", {"id": "c-1", "name": "Ada"})]),
    Case("unique sign-up", "(fix) a unique constraint", SIGNUP_UNIQUE,
         [Sample("SignedUp", {"email": "ada@example.com"}) for _ in range(2)]),
    Case("shipped credit", "(fix) the shipped credit handler", SHIPPED_CREDIT,
         [Sample("CreditRequested", {"account_id": "acct-1", "amount": a})
          for a in ("10.00", "2.50", "7.25")]),
    Case("shipped pricing", "(fix) expected-version commands", SHIPPED_PRICING,
         [Sample("ChangeProductPrice", {"product_id": "p-1", "price": p, "expected_version": v})
          for p, v in (("12.50", 1), ("11.00", 1), ("13.00", 2))],
         given=[("products", {"id": "p-1", "name": "Widget", "price": "9.99", "version": 1})]),
    # state in memory
    Case("price cache", "state in memory: a cache", PRICE_CACHE,
         [Sample("ItemOrdered", {"sku": "p-1", "quantity": 2}),
          Sample("ProductPriced", {"sku": "p-1", "price": "12.00"}),
          Sample("ItemOrdered", {"sku": "p-1", "quantity": 1})],
         frozenset({STATE}), [("ev_products", {"sku": "p-1", "price": "10.00"})], default=SQLITE),
    Case("seen ids", "state in memory: a set of seen ids", SEEN_IDS, _credits(),
         frozenset({STATE}), _WALLET, default=SQLITE),
    Case("invoice counter", "state in memory: a counter", INVOICE_NUMBERS,
         [Sample("InvoiceIssued", {"customer_id": c}) for c in ("c-1", "c-2", "c-3")],
         frozenset({STATE})),
    Case("cache in another module", "state in memory: another module's cache", HELPER_CACHE,
         [Sample("ItemOrdered", {"sku": "p-1", "quantity": 2}),
          Sample("ProductPriced", {"sku": "p-1", "price": "12.00"}),
          Sample("ItemOrdered", {"sku": "p-1", "quantity": 1})],
         frozenset({STATE}), [("ev_products", {"sku": "p-1", "price": "10.00"})]),
    Case("class attribute", "state in memory: a class attribute", CLASS_SEEN,
         _TICKS, frozenset({UNSTABLE}), _TALLY),
    Case("constant cache", "(fix) a cache of constants", CONFIG_CACHE,
         [Sample("SaleMade", {"country": c, "amount": "100.00"}) for c in ("DE", "FR", "DE")]),
    # calls to the outside
    Case("HTTP call in a transaction", "non-idempotent external call", wrong.CHARGING,
         _CHARGE, frozenset({OUTSIDE_CLAIM}), needs=frozenset({_P})),
    Case("module HTTP client", "connection reused across messages", MODULE_CLIENT, _CHARGE,
         frozenset({OUTSIDE_CLAIM}), needs=frozenset({_P}), default=SQLITE),
    Case("module broker channel", "connection reused across messages", MODULE_BROKER,
         [Sample("OrderShipped", {"order_ref": r}) for r in ("o-1", "o-2")],
         frozenset({OUTSIDE_CLAIM}), needs=frozenset({"rabbitmq"})),
    Case("claim with a uuid4 key", "non-deterministic idempotency key", CLAIM_RANDOM_KEY,
         _CHARGE, frozenset({REPEATED_CALL}), needs=frozenset({_P}), default=SQLITE),
    Case("claim without a key", "no idempotency key", CLAIM_NO_KEY, _CHARGE,
         frozenset({REPEATED_CALL}), needs=frozenset({_P})),
    Case("claim", "(fix) a claim with ctx.idempotency_key", wrong.CHARGING_FIXED, _CHARGE,
         needs=frozenset({_P}), default=SQLITE),
    Case("claim with the key in the body", "(fix) ctx.idempotency_key sent in the body",
         CLAIM_KEY_IN_BODY, _CHARGE, needs=frozenset({_P})),
    Case("claim on a module client", "(fix) a claim on a client kept open",
         MODULE_CLIENT_CLAIM, _CHARGE, needs=frozenset({_P})),
    # order, duplicates without the inbox
    Case("unsequenced price", "order: the sequence ignored", UNSEQUENCED_PRICE, _PRICES_SET,
         frozenset({OUT_OF_ORDER}), default=SQLITE),
    Case("no-inbox name", "order: a late redelivery without the inbox", NO_INBOX_NAME,
         [Sample("NameSet", {"profile_id": "p-1", "name": n}) for n in ("Ada", "Grace")],
         frozenset({OUT_OF_ORDER}), default=SQLITE),
    Case("sequenced price", "(fix) the sequence compared, without the inbox",
         SEQUENCED_PRICE, _PRICES_SET, default=SQLITE),
    Case("no-inbox increment", "an increment without the inbox", NO_INBOX_TALLY,
         _TICKS, frozenset({NO_INBOX}), _TALLY),
    Case("last-id check without the inbox", "a duplicate check of its own", LAST_ID,
         _TICKS, frozenset({NO_INBOX}), _TALLY),
    Case("ledger without the inbox", "(fix) an inbox of its own", LEDGER, _TICKS,
         given=_TALLY),
    Case("cancel by delete", "(fix) a DELETE after a read", CANCEL,
         [Sample("OrderCancelled", {"order_id": n}) for n in (1, 2, 1)],
         given=[("ev_baskets", {"id": n, "shopper_id": "s-1", "status": "open"})
                for n in (1, 2)]),
    Case("parent and children", "(fix) rows with generated keys, a versioned parent",
         PARENT_CHILD,
         [Sample("BasketFilled", {"shopper_id": "s-1", "skus": s}) for s in (["a", "b"], ["c"])],
         given=[("ev_shoppers", {"id": "s-1", "baskets": 0, "version": 1})]),
    Case("GET inside a transaction", "(fix) a safe request, a clock in a column", RATES,
         [Sample("PaymentReceived", {"account_id": "a-1", "amount": a}) for a in ("10", "4")]),
    Case("uuid4 outbox id", "an id made anew on each attempt", wrong.RENAMING,
         [Sample("ProfileRenamed", {"profile_id": "p-1", "name": "Ada"})],
         frozenset({NEW_ID})),
    Case("ctx.publish", "(fix) ids derived from the message", wrong.RENAMING_FIXED,
         [Sample("ProfileRenamed", {"profile_id": "p-1", "name": "Ada"})]),
)  # fmt: skip

MODELS = [Base.metadata, wrong.Base.metadata]
