"""An idempotent, concurrency-safe message-consumer worker.

Handlers are registered with :func:`handler` and get a :class:`Context` whose
``session`` is the pump's: the pump inserts the inbox marker and commits once.
"""

from worker.errors import Poison, Retry
from worker.registry import Context, Registry, handler, registry

__all__ = ["Context", "Poison", "Registry", "Retry", "handler", "registry"]
