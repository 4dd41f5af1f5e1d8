"""The reference handler: credit an account, by read-modify-write on purpose.

Two different messages crediting one account at once would lose an update
here; the ``version`` token turns that into a conflict the pump retries on a
fresh session, where the handler sees the other credit and adds to it.
"""

from __future__ import annotations

from decimal import Decimal

from pydantic import BaseModel, ConfigDict
from sqlalchemy import Integer, Numeric, String
from sqlalchemy.orm import Mapped, mapped_column

from worker import Base, Context, handler, insert_ignoring_conflicts


class Account(Base):
    __tablename__ = "accounts"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    balance: Mapped[Decimal] = mapped_column(Numeric(18, 2), default=Decimal(0))
    version: Mapped[int] = mapped_column(Integer, nullable=False)

    __mapper_args__ = {"version_id_col": version}


class CreditRequested(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    account_id: str
    amount: Decimal


# key: credits to one account queue up inside the process instead of colliding on its
# version token (across replicas the token and the pump's retry still decide)
@handler("CreditRequested", CreditRequested, consumer="credit", key=lambda m: m.account_id)
async def apply_credit(ctx: Context, message: CreditRequested) -> None:
    session = ctx.session
    account = await session.get(Account, message.account_id)
    if account is None:
        # Two first credits to a new account race on its primary key: insert it
        # "if absent" and load whichever row won, instead of failing one of them.
        new = {"id": message.account_id, "balance": Decimal(0), "version": 1}
        await session.execute(insert_ignoring_conflicts(session, Account).values(new))
        account = await session.get_one(Account, message.account_id)
    account.balance += message.amount


class CreditApplied(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    credit_id: str
    account_id: str
    amount: Decimal


async def apply_credit_and_announce(ctx: Context, message: CreditRequested) -> None:
    """:func:`apply_credit`, then a ``CreditApplied`` event through the outbox.

    Not registered by default (``worker demo`` registers it): the event commits with
    the credit or not at all, and the relay sends it after the commit.
    """
    await apply_credit(ctx, message)
    event = CreditApplied(
        credit_id=ctx.message_id, account_id=message.account_id, amount=message.amount
    )
    await ctx.publish("CreditApplied", event, key=message.account_id)
