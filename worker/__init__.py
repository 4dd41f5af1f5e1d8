"""An idempotent, concurrency-safe message-consumer worker.

Handlers are registered with :func:`handler` and get a :class:`Context` whose
``session`` is the pump's: the pump inserts the inbox marker and commits once.
This module is the handler author's whole API: ``handlers/`` imports only from here.
"""

from importlib import metadata as _metadata

from worker.claims import ClaimContext, side_effect
from worker.concurrency import Policy, guarded_delete, guarded_update, save
from worker.context import BatchContext, Context
from worker.db import Base, insert_ignoring_conflicts
from worker.errors import (
    ConfigurationError,
    MergeConflict,
    Poison,
    PreconditionFailed,
    Rejected,
    Retry,
    RowDeleted,
)
from worker.registry import Registry, handler, registry
from worker.settings import handler_settings
from worker.settings import load as load_settings

try:
    __version__ = _metadata.version("idempotent-worker")
except _metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, never installed
    __version__ = "unknown"

__all__ = [
    "Base",
    "BatchContext",
    "ClaimContext",
    "ConfigurationError",
    "Context",
    "MergeConflict",
    "Poison",
    "Policy",
    "PreconditionFailed",
    "Registry",
    "Rejected",
    "Retry",
    "RowDeleted",
    "guarded_delete",
    "guarded_update",
    "handler",
    "handler_settings",
    "insert_ignoring_conflicts",
    "load_settings",
    "registry",
    "save",
    "side_effect",
]
