"""Every name the test kit takes from the worker's core, in one place.

The kit runs the real pump (``Pump(broker, engine, registry, settings)`` and
``pump.running()``, with the kit's probe as stage middleware) and watches each
handler's stage: it needs the stage's shape (``stage.handler``, ``stage.items``: each
item's ``delivery``, ``message_id`` and ``message(handler)``), the verdicts a stage
returns, and the flag the pump raises while a handler's own code runs. When the core
moves one of these, this is the module to adjust; the rest of the kit imports them from
here.
"""

from __future__ import annotations

from worker.context import HANDLER_RUNNING
from worker.middleware import NextStage
from worker.pump import Pump
from worker.transaction import Stage
from worker.verdict import Verdict

__all__ = ["NextStage", "Pump", "Stage", "Verdict", "handler_call"]


def handler_call() -> object | None:
    """The handler call in progress in this task (a new object per attempt), else None:
    set by the pump around the handler's own code, not around its own statements."""
    running = HANDLER_RUNNING.get()
    return running if running is not False else None
