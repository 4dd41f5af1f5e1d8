"""Backoff for in-process retries: exponential with full jitter, capped."""

from __future__ import annotations

import random


def backoff(attempt: int, base: float, cap: float) -> float:
    """Seconds to wait before attempt ``attempt + 1``; uniform in [0, min(cap, base*2^(attempt-1))].

    Full jitter keeps replicas that collided on a hot row from colliding again
    in lockstep, which is how an unbounded retry turns into a livelock.
    """
    return random.uniform(0.0, min(cap, base * (1 << min(max(0, attempt - 1), 30))))
