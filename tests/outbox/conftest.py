"""Outbox fixtures: publishing defaults per test, a recording publisher, running relays."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from tests.outbox.outbox_helpers import RecordingPublisher, RunningRelays, fast_outbox
from worker.outbox.model import OutboxSettings, configure
from worker.outbox.relay import Relay


@pytest.fixture(autouse=True)
def outbox_settings() -> Iterator[OutboxSettings]:
    """Publishing defaults for the test (not the environment's), reset afterwards."""
    settings = fast_outbox()
    configure(settings)
    yield settings
    configure(None)


@pytest.fixture
def publisher() -> RecordingPublisher:
    return RecordingPublisher()


@pytest.fixture
def running_relays() -> RunningRelays:
    """``async with running_relays(relays):`` runs them as tasks and stops them on exit."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def run(relays: list[Relay]) -> AsyncIterator[list[Relay]]:
        tasks = [asyncio.create_task(relay.run()) for relay in relays]
        try:
            yield relays
        finally:
            for relay in relays:
                relay.stop()
            async with asyncio.timeout(10):
                await asyncio.gather(*tasks)

    return run
