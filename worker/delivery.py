"""The broker-agnostic delivery and the settlement seam every adapter implements."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from worker.errors import AcksFailed, AlreadySettled, SettlementLost
from worker.logs import scrub

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession


class Settler(Protocol):
    """How one broker settles a delivery; ``handle`` is the adapter's own object.

    Only :mod:`worker.settle` calls the four verbs. ``keep_alive`` and ``in_commit``
    are the unit of work telling the adapter what it is doing with its deliveries; they
    do nothing by default, which an adapter gets by subclassing this Protocol
    explicitly (RabbitMQ, memory: nothing expires while a delivery is held, nothing of
    theirs commits with the handler's transaction). ``watches`` and ``writes_in_commit``
    say whether they do anything, so a delivery's path calls neither where they don't.
    """

    watches: bool = False
    """Whether ``keep_alive`` does anything (a watchdog to feed, a lock to renew)."""
    writes_in_commit: bool = False
    """Whether ``in_commit`` writes anything (Kafka: offsets kept in the database)."""

    async def ack(self, handle: Any) -> None: ...

    async def ack_many(self, handles: Sequence[Any]) -> list[Any]:
        """Ack several deliveries at once (one frame where the broker allows it); returns
        the handles whose ack was lost."""
        ...

    async def nack(self, handle: Any, delay: float | None, counted: bool) -> None:
        """Give the message back. ``counted=False``: the message is not to blame (a
        database outage, a shutdown, a conflict lost to another writer), so the
        delivery count it carries on its next delivery must not grow."""
        ...

    async def dead_letter(self, handle: Any, reason: str) -> None: ...

    def keep_alive(self, handle: Any, seconds: float) -> None:
        """The delivery's work starts a phase that may take ``seconds`` from now (an
        attempt, a retry, a batch's fallback): a watchdog or a lock must allow that long."""
        return None

    async def in_commit(self, session: AsyncSession, handles: Sequence[Any]) -> None:
        """Awaited with the session just before the worker commits the work of these
        deliveries (all of them this settler's): the adapter's own writes that must
        commit with it (Kafka: the offsets, with ``WORKER_KAFKA_OFFSETS=database``)."""
        return None


H = TypeVar("H")


async def ack_each(ack: Callable[[H], Awaitable[None]], handles: Sequence[H]) -> list[H]:
    """``ack_many`` for a broker that settles one delivery per call: each acked on its own;
    returns the handles whose settlement was lost. The others' errors (a bug in the
    adapter, a handle settled twice) are raised together once the rest are acked."""
    lost = []
    failed: list[tuple[Any, Exception]] = []
    for handle in handles:
        try:
            await ack(handle)
        except SettlementLost:
            lost.append(handle)
        except Exception as exc:
            failed.append((handle, exc))
    if failed:
        raise AcksFailed(failed)
    return lost


class Delivery:
    """One delivery of one message, settled exactly once.

    ``delivery_count`` is 1 on the first delivery, whatever the broker's own
    convention; ``message_id`` is the dedup key the adapter extracted (``None``
    when the message carries none; intake refuses any id that is not a non-empty
    string).

    What an adapter says besides: ``suspect`` when the broker took the message back
    from a consumer that never settled it (a process that died, a connection or lock
    that was lost), so that an earlier delivery may have been running when that
    consumer died; ``give_backs``, the uncounted give-backs the message has had so
    far, carried across them by the adapter (a bound for the paths that spend no
    count); ``group`` names deliveries that must run in order, one unit of work at a
    time (Kafka: the partition; ``None``: no order).
    """

    __slots__ = (
        "_handle",
        "_settler",
        "body",
        "delivery_count",
        "give_backs",
        "group",
        "headers",
        "message_id",
        "refusal",
        "settled",
        "suspect",
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
        *,
        suspect: bool = False,
        give_backs: int = 0,
        refusal: str | None = None,
    ) -> None:
        self.message_id = message_id
        self.type = type
        self.body = body
        self.headers = headers
        self.delivery_count = delivery_count
        self._settler = settler
        self._handle = handle
        self.suspect = suspect
        self.give_backs = give_backs
        self.refusal = refusal
        self.settled: str | None = None
        self.group: Hashable = None

    @property
    def redelivered(self) -> bool:
        """Only a redelivery can be a broker-made duplicate of work already done."""
        return self.delivery_count > 1 or self.suspect

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

    def keep_alive(self, seconds: float) -> None:
        """This delivery's work starts a phase that may take ``seconds`` (see :class:`Settler`)."""
        if self.settled is None:
            self._settler.keep_alive(self._handle, seconds)

    def __repr__(self) -> str:
        return (
            f"<Delivery id={self.message_id!r} type={self.type!r} "
            f"count={self.delivery_count} settled={self.settled}>"
        )


def _by_settler(deliveries: Sequence[Delivery]) -> dict[int, tuple[Settler, list[Delivery]]]:
    groups: dict[int, tuple[Settler, list[Delivery]]] = {}
    for delivery in deliveries:
        settler = delivery._settler
        groups.setdefault(id(settler), (settler, []))[1].append(delivery)
    return groups


async def ack_many(deliveries: Sequence[Delivery]) -> list[Delivery]:
    """Ack deliveries together, one call per settler; returns the ones whose ack was lost.

    :class:`~worker.errors.AcksFailed` names the deliveries whose ack failed (left
    unsettled: not taken for acked), the others having gone out. Any other error means a
    settler sent nothing of its own: its deliveries, and those of the settlers after it,
    are left unsettled when it propagates.
    """
    failed: list[tuple[Any, Exception]] = []
    claimed: list[Delivery] = []
    for delivery in deliveries:
        try:
            delivery._claim("acked")
        except AlreadySettled as exc:  # a bug: reported, and the others still go out
            failed.append((delivery, exc))
        else:
            claimed.append(delivery)
    groups = list(_by_settler(claimed).values())
    lost: list[Delivery] = []
    for index, (settler, members) in enumerate(groups):
        by_handle = {id(d._handle): d for d in members}
        try:
            lost_handles = await settler.ack_many([d._handle for d in members])
        except AcksFailed as exc:
            lost_handles = []
            for handle, error in exc.failures:
                delivery = by_handle[id(handle)]
                delivery.settled = None
                failed.append((delivery, error))
        except BaseException:
            for _, unsent in groups[index:]:
                for delivery in unsent:
                    delivery.settled = None
            raise
        lost.extend(by_handle[id(h)] for h in lost_handles)
    if failed:
        raise AcksFailed(failed)
    return lost


async def in_commit(session: AsyncSession, deliveries: Sequence[Delivery]) -> None:
    """The adapters' own writes for these deliveries, in the transaction about to commit."""
    for settler, members in _by_settler(deliveries).values():
        await settler.in_commit(session, [d._handle for d in members])
