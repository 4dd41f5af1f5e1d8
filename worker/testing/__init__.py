"""The test kit for handler authors: your handlers on the real pump, and a proof that they
are idempotent under the races the worker exists for.

- :func:`harness` (the ``worker_harness`` fixture): two pumps on the memory broker over
  a database of the kit's own; deliver a message, the same one twice, or to both
  replicas at once, then read the settlements, dead letters, inbox markers, claims,
  outbox rows and tables.
- :func:`prove_idempotent` (``worker check`` on the command line): sample messages
  through duplicates, twins, separate replicas, crashes at every statement, a concurrent
  writer, two messages racing, messages out of order, late redeliveries and a lost ack,
  each compared with applying every message once.

The pytest plugin (:mod:`worker.testing.plugin`) is registered under the ``pytest11``
entry point: installing the package is enough. See docs/testing.md.
"""

from worker.testing.causes import (
    COMMITTED,
    ESCAPED,
    LOST,
    NEW_ID,
    NO_INBOX,
    NO_TOKEN,
    NOT_ONCE,
    OUT_OF_ORDER,
    OUTSIDE_CLAIM,
    RACED,
    REPEATED_CALL,
    STATE,
    SWALLOWED,
    UNKNOWN,
    UNSTABLE,
)
from worker.testing.check import Sample, check_idempotent, prove_idempotent
from worker.testing.harness import (
    Delivered,
    Harness,
    HarnessFactory,
    Marker,
    OutboxRow,
    Settled,
    harness,
)
from worker.testing.probe import SimulatedCrash
from worker.testing.report import SCENARIOS, Finding, NotIdempotent, Report
from worker.testing.scratch import Scratch, open_scratch

__all__ = [
    "COMMITTED",
    "ESCAPED",
    "LOST",
    "NEW_ID",
    "NOT_ONCE",
    "NO_INBOX",
    "NO_TOKEN",
    "OUTSIDE_CLAIM",
    "OUT_OF_ORDER",
    "RACED",
    "REPEATED_CALL",
    "SCENARIOS",
    "STATE",
    "SWALLOWED",
    "UNKNOWN",
    "UNSTABLE",
    "Delivered",
    "Finding",
    "Harness",
    "HarnessFactory",
    "Marker",
    "NotIdempotent",
    "OutboxRow",
    "Report",
    "Sample",
    "Scratch",
    "Settled",
    "SimulatedCrash",
    "check_idempotent",
    "harness",
    "open_scratch",
    "prove_idempotent",
]
