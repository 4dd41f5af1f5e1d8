"""The project's own exceptions. Adapters translate vendor errors into these."""

from __future__ import annotations


class WorkerError(Exception):
    """Base class for every error this package raises on purpose."""


class ConfigurationError(WorkerError):
    """Bad settings: reported as one line at start, never as a traceback."""


class AlreadySettled(WorkerError):
    """A delivery was acked, nacked or dead-lettered twice."""


class SettlementLost(WorkerError):
    """The broker no longer accepts this settlement (lock lost, channel closed).

    The broker will redeliver the message; this is never a success.
    """


class BrokerUnavailable(WorkerError):
    """The broker connection is down; the adapter is reconnecting."""


class TransactionOwnedByPump(WorkerError):
    """A handler tried to commit, roll back or close the pump's session."""


class Poison(WorkerError):
    """A message that can never succeed: dead-letter it at once with this reason."""


class Retry(WorkerError):
    """Raised by a handler to ask for a redelivery after ``delay`` seconds."""

    def __init__(self, reason: str = "retry requested", *, delay: float | None = None) -> None:
        super().__init__(reason)
        self.delay = delay
