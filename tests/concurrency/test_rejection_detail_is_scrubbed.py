"""A rejection's text is kept in ``rejections.detail``: never with a secret it quoted."""

from __future__ import annotations

from typing import cast

from pydantic import BaseModel
from sqlalchemy import Table, select
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.support.pumps import MakeSettings, RunPumps
from worker.brokers.memory import MemoryBroker
from worker.errors import Rejected
from worker.registry import Context, Registry
from worker.rejections import Rejection

SECRET = "S3cr3tPassw0rd"
QUOTED = f"ledger at postgresql://ledger:{SECRET}@host/db refused the transfer"


class Transfer(BaseModel):
    account: str


async def test_a_rejection_quoting_a_database_url_is_stored_without_its_password(
    engine: AsyncEngine, make_settings: MakeSettings, run_pumps: RunPumps
) -> None:
    registry = Registry()

    @registry.handler("Transfer", Transfer, consumer="ledger")
    async def transfer(ctx: Context, message: Transfer) -> None:
        raise Rejected("the ledger refused it", subject=message.account, detail=QUOTED)

    @registry.handler("Refund", Transfer, consumer="refunds")
    async def refund(ctx: Context, message: Transfer) -> None:
        raise Rejected(QUOTED)  # no detail: the message itself is stored

    broker = MemoryBroker()
    async with run_pumps([broker.connect()], [engine], registry, make_settings()):
        broker.publish("m1", "Transfer", {"account": "a1"})
        broker.publish("m2", "Refund", {"account": "a1"})
        await broker.wait_idle(10)
    table = cast(Table, Rejection.__table__)
    async with engine.connect() as connection:
        details = list(
            (await connection.execute(select(table.c.detail).order_by(table.c.id))).scalars()
        )
    assert len(details) == 2
    for detail in details:
        assert SECRET not in detail
        assert detail == "ledger at postgresql://ledger:***@host/db refused the transfer"
