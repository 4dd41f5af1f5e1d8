"""The broker-agnostic delivery and the settlement seam every adapter implements."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from worker.errors import AlreadySettled, SettlementLost
from worker.logs import scrub

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

InTransaction = Callable[["AsyncSession"], Awaitable[None]]


class Settler(Protocol):
    """How one broker settles a delivery; ``handle`` is the adapter's own object."""

    async def ack(self, handle: Any) -> None: ...

    async def nack(self, handle: Any, delay: float | None, counted: bool) -> None:
        """Give the message back. ``counted=False``: the message is not to blame (a
        database outage, a shutdown, a conflict lost to another writer), so the
        delivery count it carries on its next delivery must not grow."""
        ...

    async def dead_letter(self, handle: Any, reason: str) -> None: ...


class Delivery:
    """One delivery of one message, settled exactly once.

    ``delivery_count`` is 1 on the first delivery, whatever the broker's own
    convention; ``message_id`` is the dedup key the adapter extracted (``None``
    when the message carries none, which the pump dead-letters).

    Two optional seams for adapters: ``group`` names the deliveries that may share
    one batch transaction (Kafka: the partition; ``None``: any of the same type), and
    ``in_transaction`` is awaited with the session before the pump commits a
    handler's work for this delivery (Kafka: the offset, stored in that commit).
    """

    __slots__ = (
        "_handle",
        "_settler",
        "body",
        "delivery_count",
        "group",
        "headers",
        "in_transaction",
        "message_id",
        "settled",
        "type",
    )

    def __init__(
        self,
        message_id: str | None,
        type: str | None,
        body: bytes,
        headers: Mapping[str, Any],
        delivery_count: int,
        settler: Settler,
        handle: Any,
    ) -> None:
        self.message_id = message_id
        self.type = type
        self.body = body
        self.headers = headers
        self.delivery_count = delivery_count
        self._settler = settler
        self._handle = handle
        self.settled: str | None = None
        self.group: Hashable = None
        self.in_transaction: InTransaction | None = None

    @property
    def redelivered(self) -> bool:
        """Only a redelivery can be a broker-made duplicate of work already done."""
        return self.delivery_count > 1

    def _claim(self, verb: str) -> None:
        if self.settled is not None:
            raise AlreadySettled(f"delivery {self.message_id!r} already {self.settled}, not {verb}")
        self.settled = verb

    async def ack(self) -> None:
        self._claim("acked")
        await self._settler.ack(self._handle)

    async def nack(self, delay: float | None = None, *, counted: bool = True) -> None:
        """Give the message back for redelivery, after ``delay`` seconds where supported.

        ``counted=False`` keeps the delivery count where it is: only a message's own
        failures may push it toward the dead-letter queue.
        """
        self._claim("nacked")
        await self._settler.nack(self._handle, delay, counted)

    async def dead_letter(self, reason: str) -> None:
        """Move the message to the dead-letter queue; the reason leaves the process scrubbed."""
        self._claim("dead-lettered")
        await self._settler.dead_letter(self._handle, scrub(reason))

    def __repr__(self) -> str:
        return (
            f"<Delivery id={self.message_id!r} type={self.type!r} "
            f"count={self.delivery_count} settled={self.settled}>"
        )


async def ack_many(deliveries: Sequence[Delivery]) -> list[Delivery]:
    """Ack deliveries of one settler; returns the ones whose ack was lost.

    An adapter may offer ``ack_many(handles) -> lost handles`` (RabbitMQ: one
    ``basic.ack(multiple=True)`` where that is safe); without it they are acked one by one.
    """
    for delivery in deliveries:
        delivery._claim("acked")
    if not deliveries:
        return []
    settler = deliveries[0]._settler
    bulk = getattr(settler, "ack_many", None)
    if bulk is not None and all(d._settler is settler for d in deliveries):
        by_handle = {id(d._handle): d for d in deliveries}
        lost_handles = await bulk([d._handle for d in deliveries])
        return [by_handle[id(h)] for h in lost_handles]
    lost = []
    for delivery in deliveries:
        try:
            await delivery._settler.ack(delivery._handle)
        except SettlementLost:
            lost.append(delivery)
    return lost
