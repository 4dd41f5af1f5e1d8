"""The project's own exceptions. Adapters translate vendor errors into these."""

from __future__ import annotations

from typing import Any

from worker.verdict import Outcome


class WorkerError(Exception):
    """Base class for every error this package raises on purpose."""


class ConfigurationError(WorkerError):
    """Bad settings: reported as one line at start, never as a traceback."""


class MigrationFailed(WorkerError):
    """A migration history that cannot be migrated as it stands: a revision the database
    records and the code does not ship, a broken revision file, a database not at head
    for autogenerate. Reported as one line naming the history."""


class AlreadySettled(WorkerError):
    """A delivery was acked, nacked or dead-lettered twice."""


class AcksFailed(WorkerError):
    """Some acks of a group failed (the others went out): ``failures`` pairs each failed
    handle (or delivery) with its error."""

    def __init__(self, failures: list[tuple[Any, Exception]]) -> None:
        super().__init__(f"{len(failures)} acks failed: {failures[0][1]!r}")
        self.failures = failures


class SettlementLost(WorkerError):
    """The broker no longer accepts this settlement (lock lost, channel closed).

    The broker will redeliver the message; this is never a success.
    """


class BrokerUnavailable(WorkerError):
    """The broker connection is down; the adapter is reconnecting."""


class PublishStopped(WorkerError):
    """``worker publish`` stopped part way: ``confirmed`` are the indexes (in the input) of
    the messages the broker confirmed; the others may or may not have gone out.
    ``configuration``: a message the broker cannot route (a setting to fix)."""

    def __init__(self, message: str, confirmed: list[int], *, configuration: bool = False) -> None:
        super().__init__(message)
        self.confirmed = confirmed
        self.configuration = configuration


class TransactionOwnedByPump(WorkerError):
    """A handler tried to commit, roll back or close the pump's session."""


class StatementSwallowed(WorkerError):
    """A statement failed inside the handler and the handler carried on without a savepoint.

    The cause is the database error the handler caught. On PostgreSQL the
    transaction is aborted by then and a COMMIT would silently roll back.
    """


class DatabaseUnreachable(WorkerError):
    """An attempt cut because the database stopped answering (a black hole): the
    environment's fault, like a lost connection."""


class HandlerFailed(WorkerError):
    """A handler raised a ``BaseException`` that is not an ``Exception`` (a
    ``CancelledError`` of its own, not the worker's cancellation): its failure like any
    other, so the task that ran it survives, settles it and frees its lanes."""


class HandlerTimeout(WorkerError):
    """The handler ran longer than ``WORKER_HANDLER_TIMEOUT`` and was cancelled;
    ``late``: seconds its cancellation took to come back (a statement cancelled on a
    database that does not answer hangs as long as the database does)."""

    def __init__(self, reason: str, *, late: float = 0.0) -> None:
        super().__init__(reason)
        self.late = late


class Poison(WorkerError):
    """A message that can never succeed: dead-letter it at once with this reason."""


class Retry(WorkerError):
    """Raised by a handler to ask for a redelivery after ``delay`` seconds."""

    def __init__(self, reason: str = "retry requested", *, delay: float | None = None) -> None:
        super().__init__(reason)
        self.delay = delay


class Rejected(WorkerError):
    """Not applied and never retried: the pump records it (table ``rejections``) and acks.

    Raised for outcomes that are final by design: the sender's expected version
    no longer matches, the row is gone, or a merge found both sides changed one
    field. Retrying would either fail forever or apply the change over newer data.
    """

    outcome = Outcome.REJECTED

    def __init__(
        self,
        message: str,
        *,
        subject: str | None = None,
        expected: int | None = None,
        actual: int | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.subject = subject
        self.expected = expected
        self.actual = actual
        self.detail = detail


class PreconditionFailed(Rejected):
    """The sender's ``expected_version`` is not the row's version (HTTP 412, as a message)."""

    outcome = Outcome.PRECONDITION_FAILED


class RowDeleted(Rejected):
    """A version-token conflict on a row that no longer exists: not a change to retry."""

    outcome = Outcome.DELETED


class MergeConflict(Rejected):
    """A merge found a field that both this handler and another writer changed, differently."""

    outcome = Outcome.MERGE_CONFLICT

    def __init__(
        self, message: str, *, fields: tuple[str, ...], subject: str | None = None
    ) -> None:
        super().__init__(message, subject=subject, detail="fields: " + ", ".join(fields))
        self.fields = fields
