"""Clock skew: each received message's broker timestamps against the local clock.

The SDK checks a lock against the local clock before it settles (``locked_until_utc``,
the broker's time, against the local time) and refuses without asking the service, and
its renewer decides from the local clock when to renew. A local clock ahead of the
broker's makes it refuse settlements on locks it believes expired; one behind makes the
renewer renew too late. Neither is proven by one message, but each bound is: a lock
already expired on arrival (ahead), a lock longer than any lock can be or a message
enqueued in the local future (behind).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from worker.brokers.servicebus import messages

if TYPE_CHECKING:
    from azure.servicebus import ServiceBusReceivedMessage

MAX_LOCK_DURATION = 300.0  # Service Bus's longest lock duration, s
_LOG_EVERY = 60.0  # one clock-skew warning a minute; the counter counts every message


class ClockCheck:
    """Logs (once a minute) and counts (every message) a skew the lock checks would trip over."""

    def __init__(self, tolerance: float, stats: Counter[str], log: Any) -> None:
        self.tolerance = tolerance
        self.skew = 0.0  # the last skew seen (local minus broker, a lower bound), s
        self._stats = stats
        self._log = log
        self._logged = -_LOG_EVERY

    def __call__(self, message: ServiceBusReceivedMessage, message_id: str | None) -> None:
        now = messages.wall()  # looked up on the module: tests move this one clock
        tolerance = self.tolerance
        skew = 0.0  # local minus broker, at least: > 0 ahead, < 0 behind
        enqueued = message.enqueued_time_utc
        if enqueued is not None and enqueued.timestamp() - now > tolerance:
            skew = now - enqueued.timestamp()  # enqueued in the local future
        locked = message.locked_until_utc
        if locked is not None:
            left = locked.timestamp() - now
            if left <= 0:
                skew = -left  # the lock looks expired the moment it arrives
            elif left > MAX_LOCK_DURATION + tolerance:
                skew = min(skew, MAX_LOCK_DURATION - left)  # longer than any lock can be
        if skew == 0.0:
            return
        self._stats["clock_skew"] += 1
        self.skew = skew
        if time.monotonic() - self._logged < _LOG_EVERY:
            return
        self._logged = time.monotonic()
        self._log.warning(
            "servicebus clock skew: the local clock disagrees with the broker's",
            skew_s=round(skew, 1),
            local_clock="ahead" if skew > 0 else "behind",
            message_id=message_id,
            enqueued=enqueued.isoformat() if enqueued is not None else None,
            locked_until=locked.isoformat() if locked is not None else None,
            outcome="clock-skew",
        )
