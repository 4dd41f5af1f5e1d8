"""Side effects that cannot join the transaction: two-phase claims with a lease.

An e-mail, a card charge or an HTTP call cannot be rolled back with the
database, so a side-effect handler runs in phases instead of one commit::

    claim:  INSERT the marker as "claimed" with a lease, COMMIT
    call:   the handler's external call, keyed by the message id
    mark:   UPDATE the marker to "finished" with the outcome, COMMIT

A redelivery finds the marker and decides from its state:

=====================================  ================================================
marker                                 what happens
=====================================  ================================================
finished                               ack: the call was made and recorded
claimed, lease still running           nack after the rest of the lease: the owner may
                                       still be calling, and if it died we come back
claimed, lease expired                 take it over with a conditional UPDATE (one
                                       replica wins), repeat the call with the same key
abandoned                              take it over at once, as if there were no marker
=====================================  ================================================

A crash between claim and call therefore delays the call by one lease instead
of skipping it forever; a crash between call and mark repeats the call with the
same idempotency key, which the provider deduplicates. A failed call releases
the lease (so the redelivery may take over at once) and is never marked
finished. A call that timed out keeps its lease: its outcome is unknown (the
provider may still be working on it), so nobody calls again with the same key
until the lease has run out; the delivery comes back after the rest of the
lease. Lease times come from the database's clock on PostgreSQL, so a replica
whose clock runs fast cannot steal a live claim, and the call is bounded by the
lease as the database set it, measured from before the claim's statement was
sent: a slow claim (a commit, a lock wait) shortens the call, never the margin.

Only one replica's "finished" mark commits: a replica whose mark finds the claim
already finished (its lease ran out and a takeover finished first) rolls its
own writes back, since the winner's writes recorded the same call.

A claim whose message was dead-lettered (``Poison``, or a failure on the last
allowed delivery) is marked *abandoned*: terminal for the sweeper, which never
calls for it again, yet no obstacle to a new delivery of the message (a
re-submitted dead letter), which takes it over.

A claim stores the message body, so :mod:`worker.sweeper` (``worker sweep``)
can finish a claim left past its lease without a redelivery.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar, cast

from pydantic import BaseModel

from worker.context import Context
from worker.registry import HandlerFunc, Registry, registry

if TYPE_CHECKING:
    from worker.leases import Claim
    from worker.settings import Settings

M = TypeVar("M", bound=BaseModel)


class ClaimContext(Context):
    """The context of a side-effect handler: the claim it holds and the worker's settings.

    ``session`` is committed together with the "finished" mark, after the call.
    It connects lazily: a handler that calls first and writes afterwards holds
    no connection while it waits on the network.
    """

    __slots__ = ("call_deadline", "claim", "settings")

    claim: Claim
    settings: Settings
    call_deadline: float  # time.monotonic() by which the call is cut

    @property
    def idempotency_key(self) -> str:
        """The key the provider deduplicates repeated calls by: the message id."""
        return self.message_id

    @property
    def time_left(self) -> float:
        """Seconds until the call is cut (the call timeout or the lease, whichever ends first).

        Use it as the HTTP client's timeout, so the client gives up by itself.
        """
        return max(0.0, self.call_deadline - time.monotonic())


ClaimFunc = Callable[[ClaimContext, M], Awaitable[str | None]]
"""A side-effect handler; what it returns is stored as the claim's outcome.

An exception is a definite failure: the lease is released for a redelivery to
take over. A ``TimeoutError`` (raised, or let through from a client that gave
up waiting for an answer) means "sent, outcome unknown": the lease is kept.
"""


def side_effect(
    message_type: str, model: type[M], *, consumer: str, registry: Registry = registry
) -> Callable[[ClaimFunc[M]], ClaimFunc[M]]:
    """Register a side-effect handler: ``@side_effect("SendWelcomeEmail", Model, consumer=...)``."""

    def register(func: ClaimFunc[M]) -> ClaimFunc[M]:
        as_handler = cast(HandlerFunc[M], func)  # the pump calls it through claims.process
        registry.handler(message_type, model, consumer=consumer, side_effect=True)(as_handler)
        return func

    return register
