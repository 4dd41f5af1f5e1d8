"""``python -m benchmarks.uvloop_worker run``: ``worker run`` on uvloop's event loop.

The benchmarks' side-by-side rows for the event loop (benchmarks/throughput.py rows
marked "uvloop"); needs ``pip install uvloop``.
"""

from __future__ import annotations

import asyncio
import sys

import uvloop

from worker.cli import main

if __name__ == "__main__":
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    sys.exit(main())
