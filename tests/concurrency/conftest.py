"""Fixtures for the concurrency, claims and retention tests."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from handlers import notify
from tests.concurrency.concurrency_helpers import MailServer


@pytest.fixture
async def mail_server() -> AsyncIterator[MailServer]:
    """A mail API on 127.0.0.1; the notify handler in this process posts to it."""
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
        notify.configure(notify.MailSettings(api_url=server.url))
        yield server
    finally:
        notify.configure(None)
        await runner.cleanup()
        sock.close()
