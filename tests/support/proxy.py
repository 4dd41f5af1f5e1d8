"""A loopback TCP proxy to PostgreSQL that a test can cut and restore: a database outage
(refused connections, reset sockets) for one test's engine only, the server untouched."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit


class TcpProxy:
    """A loopback proxy to PostgreSQL that the test can cut (refuse + reset) and restore."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._accept, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._pipes):
            writer.transport.abort()
        self._pipes.clear()
        await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._pipes |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.transport.abort()
        self._pipes.discard(writer)


async def proxied(database_url: str) -> tuple[TcpProxy, str]:
    """A started proxy in front of ``database_url``'s server, and the URL that goes through it."""
    target = urlsplit(database_url.replace("postgresql+asyncpg", "postgresql"))
    proxy = TcpProxy(target.port or 5432)
    await proxy.start()
    return proxy, database_url.replace(f":{target.port}/", f":{proxy.port}/")
