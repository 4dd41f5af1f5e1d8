"""Local HTTP APIs on 127.0.0.1 for the handlers that call out: what each call did is
recorded, and :meth:`RecordingAPI.drain` hands it to the checker as the run's effects."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web


class RecordingAPI:
    """Records each call's JSON body; with ``dedup``, a call whose ``Idempotency-Key`` it has
    seen since the last drain takes no effect again, as a payment or mail provider's does."""

    def __init__(self, *, dedup: bool) -> None:
        self.dedup = dedup
        self.url = ""
        self.calls = 0
        self._effects: list[Any] = []
        self._keys: set[str] = set()

    async def handle(self, request: web.Request) -> web.Response:
        self.calls += 1
        payload = await request.json()
        key = request.headers.get("Idempotency-Key")
        if not (self.dedup and key is not None and key in self._keys):
            self._effects.append(payload)
            if key is not None:
                self._keys.add(key)
        return web.json_response({"accepted": True}, status=202)

    def drain(self) -> list[Any]:
        """The effects since the last drain; the next run starts from none."""
        effects, self._effects, self._keys = self._effects, [], set()
        return effects


@contextlib.asynccontextmanager
async def serving(api: RecordingAPI, path: str) -> AsyncIterator[RecordingAPI]:
    app = web.Application()
    app.router.add_post(path, api.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.2)
    await runner.setup()
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        api.url = f"http://127.0.0.1:{sock.getsockname()[1]}{path}"
        yield api
    finally:
        await runner.cleanup()
        sock.close()
