"""Fixtures for the concurrency, claims and retention tests."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from tests.concurrency.concurrency_helpers import MailServer


@pytest.fixture
async def mail_server() -> AsyncIterator[MailServer]:
    server = MailServer()
    app = web.Application()
    app.router.add_post("/send", server.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.2)
    await runner.setup()
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        server.url = f"http://127.0.0.1:{sock.getsockname()[1]}/send"
        yield server
    finally:
        await runner.cleanup()
        sock.close()
