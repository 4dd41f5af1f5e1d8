"""What a handler gets, and what it may not do with it.

A handler gets a :class:`Context` (a :class:`BatchContext` for a batch handler): the
pump's session and the facts of its delivery. The pump owns that session's
transaction: the marker and the handler's writes commit together, once, or not at
all. So while a handler runs (:func:`call_handler`), every way to end the transaction
early is refused (:class:`PumpSession`, and :func:`guard` on the engine for the side
doors), and a statement that failed and that the handler caught without a savepoint
is raised afterwards as :class:`~worker.errors.StatementSwallowed`: on PostgreSQL the
transaction is aborted by then, and the COMMIT would quietly roll back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from contextvars import ContextVar
from typing import Any, NoReturn

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session

from worker.errors import HandlerFailed, HandlerTimeout, StatementSwallowed, TransactionOwnedByPump
from worker.outbox.publish import add as outbox_add


class Context:
    """What a handler gets besides its message: the pump's session and the delivery's facts."""

    __slots__ = (
        "_published",
        "attempt",
        "consumer",
        "delivery_count",
        "headers",
        "message_id",
        "session",
    )

    def __init__(
        self,
        session: AsyncSession,
        message_id: str,
        consumer: str,
        delivery_count: int,
        attempt: int,
        headers: Any,
    ) -> None:
        self.session = session
        self.message_id = message_id
        self.consumer = consumer
        self.delivery_count = delivery_count
        self.attempt = attempt
        self.headers = headers
        self._published = 0  # the outbox sequence: the same ids on every re-run

    async def publish(
        self,
        message_type: str,
        body: Any,
        *,
        key: str | None = None,
        headers: dict[str, Any] | None = None,
        destination: str | None = None,
    ) -> str:
        """Publish through the outbox: a row in this session, sent after the commit.

        Nothing leaves the process until the pump commits; a rollback takes the event
        with it. ``body`` is a pydantic model, a JSON-able dict, bytes or text. The
        returned id is derived from this message's id, the consumer and the call's
        position in the handler, so a re-run publishes the same ids. ``key`` picks
        the Kafka partition and, with ``WORKER_OUTBOX_ORDERED``, the order.
        """
        sequence = self._published
        self._published += 1
        return await outbox_add(
            self,
            sequence,
            message_type,
            body,
            key=key,
            headers=headers,
            destination=destination,
        )


class BatchContext:
    """What a batch handler gets: the pump's session and the facts of every message in it.

    ``message_ids``, ``delivery_counts`` and ``headers`` run parallel to the messages;
    ``message(i)`` is the i-th message's own :class:`Context` (for ``publish``).
    """

    __slots__ = (
        "_contexts",
        "attempt",
        "consumer",
        "delivery_counts",
        "headers",
        "message_ids",
        "session",
    )

    def __init__(
        self,
        session: AsyncSession,
        consumer: str,
        attempt: int,
        message_ids: list[str],
        delivery_counts: list[int],
        headers: list[Any],
    ) -> None:
        self._contexts: list[Context | None] = [None] * len(message_ids)
        self.session = session
        self.consumer = consumer
        self.attempt = attempt
        self.message_ids = message_ids
        self.delivery_counts = delivery_counts
        self.headers = headers

    @classmethod
    def of(cls, context: Context) -> BatchContext:
        """A batch of one: how a batch handler runs one message at a time."""
        batch = cls(
            context.session,
            context.consumer,
            context.attempt,
            [context.message_id],
            [context.delivery_count],
            [context.headers],
        )
        batch._contexts[0] = context
        return batch

    def message(self, index: int) -> Context:
        context = self._contexts[index]
        if context is None:
            context = self._contexts[index] = Context(
                self.session,
                self.message_ids[index],
                self.consumer,
                self.delivery_counts[index],
                self.attempt,
                self.headers[index],
            )
        return context


# -- the pump owns the transaction ----------------------------------------------------


HANDLER_RUNNING: ContextVar[bool | list[BaseException]] = ContextVar(
    "worker_handler_running", default=False
)
"""Set while a handler runs: any commit in that time is refused. Inside the pump's
transaction it holds the statements that failed meanwhile (minus those a rolled back
savepoint undid); a claim's call, which has no transaction of the pump's, sets True."""

_SAVEPOINTS: ContextVar[list[int] | None] = ContextVar("worker_savepoints", default=None)
"""While a handler runs: the number of failures when each open savepoint began."""


async def call_handler(call: Awaitable[None], limit: float | None, what: str = "handler") -> None:
    """Await ``call`` (a handler's coroutine) inside the pump's transaction.

    Any commit the handler attempts meanwhile is refused; a statement that failed and
    that the handler caught without a savepoint is raised afterwards as
    :class:`~worker.errors.StatementSwallowed`; past ``limit`` seconds the call is
    cancelled and :class:`~worker.errors.HandlerTimeout` raised (a handler's own
    ``TimeoutError`` stays its own). A ``CancelledError`` (or any other
    ``BaseException`` but a process exit) the handler raised itself, not the worker's
    own cancellation, is the handler's failure: :class:`~worker.errors.HandlerFailed`.
    """
    failures: list[BaseException] = []
    running = HANDLER_RUNNING.set(failures)
    savepoints = _SAVEPOINTS.set([])
    try:
        if limit is None:
            await call
        else:
            cut = asyncio.timeout(limit)
            try:
                async with cut:
                    await call
            except TimeoutError as exc:
                if not cut.expired():
                    raise
                late = asyncio.get_running_loop().time() - (cut.when() or 0.0)
                raise HandlerTimeout(
                    f"{what} ran longer than WORKER_HANDLER_TIMEOUT={limit}s", late=late
                ) from exc
    except (Exception, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # CancelledError, or a BaseException of the handler's own
        if isinstance(exc, asyncio.CancelledError) and _cancelling():
            raise  # the worker's own: a shutdown past its grace period
        raise HandlerFailed(f"{what} raised {type(exc).__name__}: {exc}") from exc
    finally:
        HANDLER_RUNNING.reset(running)
        _SAVEPOINTS.reset(savepoints)
    if failures:
        raise StatementSwallowed(
            "a statement failed inside the handler and the handler carried on; "
            "the transaction is aborted: catch database errors inside "
            "`async with ctx.session.begin_nested():` instead"
        ) from failures[0]


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _refuse_while_handler_runs(what: str) -> None:
    if HANDLER_RUNNING.get() is not False:
        raise TransactionOwnedByPump(
            f"handlers must not {what}: the pump commits once, with the inbox marker"
        )


class _GuardedSession(Session):
    """The synchronous half of :class:`PumpSession`, guarded the same way.

    Closes the side doors ``session.sync_session.commit()`` and
    ``session.run_sync(lambda s: s.commit())``.
    """

    def commit(self) -> None:
        if HANDLER_RUNNING.get() is not False:
            _refuse_while_handler_runs("commit")
        super().commit()

    def rollback(self) -> None:
        if HANDLER_RUNNING.get() is not False:
            _refuse_while_handler_runs("roll back")
        super().rollback()


class PumpSession(AsyncSession):
    """The session a handler gets: the pump owns its transaction.

    A handler that commits would make its writes permanent even when the inbox
    marker is then rejected as a duplicate, so commit, rollback and close fail
    loudly here; the pump calls the :class:`AsyncSession` methods directly, and
    only after the handler returned.
    """

    sync_session_class = _GuardedSession

    async def commit(self) -> NoReturn:
        raise TransactionOwnedByPump(
            "handlers must not commit: the pump commits once, with the inbox marker"
        )

    async def rollback(self) -> NoReturn:
        raise TransactionOwnedByPump("handlers must not roll back: raise an exception instead")

    async def close(self) -> NoReturn:
        raise TransactionOwnedByPump("handlers must not close the pump's session")


def session_factory(engine: AsyncEngine) -> async_sessionmaker[PumpSession]:
    """Sessions of the pump's kind: a handler that ends their transaction is refused."""
    return async_sessionmaker(engine, class_=PumpSession, expire_on_commit=False)


def guard(engine: AsyncEngine) -> None:
    """Watch ``engine`` for what a running handler may not do: commit on a connection
    (``(await session.connection()).commit()``, or any other connection of the engine),
    and statements that fail while it runs. Idempotent."""
    sync_engine = engine.sync_engine
    if event.contains(sync_engine, "handle_error", _note_statement_failure):
        return
    event.listen(sync_engine, "commit", _refuse_connection_commit)
    event.listen(sync_engine, "handle_error", _note_statement_failure)
    event.listen(sync_engine, "savepoint", _savepoint)
    event.listen(sync_engine, "rollback_savepoint", _rollback_savepoint)
    event.listen(sync_engine, "release_savepoint", _release_savepoint)


def _refuse_connection_commit(connection: Any) -> None:
    """Raising here alone would leave the DBAPI connection inside its transaction while
    SQLAlchemy believes it ended; invalidating first discards the connection, and the
    database rolls the transaction back."""
    if HANDLER_RUNNING.get() is not False:
        connection.invalidate()
        _refuse_while_handler_runs("commit")


def _note_statement_failure(context: Any) -> None:
    failures = HANDLER_RUNNING.get()
    if isinstance(failures, list):
        failures.append(context.original_exception)


def _savepoint(_connection: Any, _name: str) -> None:
    failures, marks = HANDLER_RUNNING.get(), _SAVEPOINTS.get()
    if isinstance(failures, list) and marks is not None:
        marks.append(len(failures))


def _rollback_savepoint(_connection: Any, _name: str, _context: Any) -> None:
    failures, marks = HANDLER_RUNNING.get(), _SAVEPOINTS.get()
    if isinstance(failures, list) and marks:
        del failures[marks.pop() :]  # the savepoint undid what failed inside it


def _release_savepoint(_connection: Any, _name: str, _context: Any) -> None:
    marks = _SAVEPOINTS.get()
    if marks:
        marks.pop()
