"""Handlers for ``worker run`` processes in the outbox tests (WORKER_HANDLERS=tests.outbox...)."""

from __future__ import annotations

from pydantic import BaseModel

from worker import Context, handler


class Order(BaseModel):
    account_id: str
    amount: str


@handler("Order", Order, consumer="orders")
async def order(ctx: Context, message: Order) -> None:
    """Queue A: every order asks queue B for one credit, through the outbox."""
    body = {"account_id": message.account_id, "amount": message.amount}
    await ctx.publish("CreditRequested", body, key=message.account_id)
