"""Business handlers. Importing this package registers them (``WORKER_HANDLERS=handlers``)."""

from handlers import credit, notify, pricing

__all__ = ["credit", "notify", "pricing"]
