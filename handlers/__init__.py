"""Business handlers. Importing this package registers them (``WORKER_HANDLERS=handlers``)."""

from handlers import credit

__all__ = ["credit"]
