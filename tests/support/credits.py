"""The suite's example workload: ``CreditRequested`` messages applied by handlers/credit.py.

One builder of a credit's body and of its :class:`~worker.brokers.OutgoingMessage`, and
one registry running the reference handler (``apply_credit``) unchanged; tests that need
a handler of their own (one that fails, records or waits) still register it themselves.
"""

from __future__ import annotations

import json
from decimal import Decimal

from handlers.credit import CreditRequested, apply_credit
from worker.brokers import OutgoingMessage
from worker.registry import Registry


def credit_body(account: str, amount: Decimal | str) -> bytes:
    """The JSON body of a credit of ``amount`` to ``account``."""
    return json.dumps({"account_id": account, "amount": str(amount)}).encode()


def credit(
    message_id: str | None, account: str, amount: Decimal | str, type: str = "CreditRequested"
) -> OutgoingMessage:
    """A credit as ``worker publish`` and the adapters' admin publishers take it."""
    return OutgoingMessage(message_id, type, credit_body(account, amount))


def credit_registry(message_type: str = "CreditRequested", *, consumer: str = "credit") -> Registry:
    """The reference credit handler for ``message_type``, its inbox markers under ``consumer``."""
    registry = Registry()
    registry.handler(message_type, CreditRequested, consumer=consumer)(apply_credit)
    return registry
