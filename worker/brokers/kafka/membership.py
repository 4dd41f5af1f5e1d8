"""What aiokafka knows about this member's place in the group and does not expose.

The adapter needs three facts aiokafka keeps on its private group coordinator
(``AIOKafkaConsumer._coordinator``, a ``GroupCoordinator``) and offers no public
accessor for: the group generation (a commit is sent only in the generation its
partition was assigned in), whether the coordinator is known (readiness), and
``request_rejoin()`` (a fenced member asks the group who owns the partition). This
module is the only place that touches the private attribute, so an aiokafka release
that moves it breaks here and nowhere else; each function degrades to the safe answer
(no generation, not ready, no rejoin) when the attribute is gone, and
``tests/kafka/test_kafka_membership.py`` fails loudly if it is.

Checked against aiokafka 0.11.0, 0.12.0, 0.13.0 and 0.14.0 (pyproject allows >= 0.11):
``_coordinator`` is set by ``start()`` when a ``group_id`` is given (``None`` before),
and ``generation`` (an int, -1 outside a generation), ``coordinator_id`` (``None``
while unknown) and ``request_rejoin()`` have the same meaning in all four.
"""

from __future__ import annotations

from typing import Any


def _coordinator(consumer: Any) -> Any:
    return getattr(consumer, "_coordinator", None)


def generation(consumer: Any) -> int:
    """The group generation the member is in; -1 when it is in none."""
    value = getattr(_coordinator(consumer), "generation", -1)
    return value if isinstance(value, int) else -1


def coordinator_known(consumer: Any) -> bool:
    """The group coordinator is known: a heartbeat that cannot reach it forgets it at once."""
    return getattr(_coordinator(consumer), "coordinator_id", None) is not None


def request_rejoin(consumer: Any) -> bool:
    """Ask the group for a rebalance; False when there is no coordinator to ask."""
    coordinator = _coordinator(consumer)
    if coordinator is None:
        return False
    coordinator.request_rejoin()
    return True
