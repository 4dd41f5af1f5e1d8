"""A loopback TCP proxy a test puts between a worker and PostgreSQL or RabbitMQ, and faults:
refused connections, reset sockets and a black hole, for that test's traffic only, the
server itself untouched."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit


class TcpProxy:
    """127.0.0.1:<port> -> 127.0.0.1:<target_port>, with faults on demand.

    - :meth:`refuse`: the listening socket closes (connection refused) and every open
      connection is reset; :meth:`heal` listens again on the same port.
    - :meth:`reset`: every open connection is reset; new ones still go through.
    - :meth:`blackhole`: connections stay open and new ones are accepted, but no byte
      moves either way until :meth:`heal` (a partition: the peer vanishes without a word).
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._accept, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    def reset(self) -> None:
        for writer in list(self._pipes):
            writer.transport.abort()
        self._pipes.clear()

    async def refuse(self) -> None:
        if self._server is not None:
            self._server.close()
            self.reset()
            await self._server.wait_closed()
            self._server = None

    cut = refuse  # the name the older tests use

    def blackhole(self) -> None:
        self._flowing.clear()

    async def heal(self) -> None:
        self._flowing.set()
        if self._server is None:
            await self.start()

    async def close(self) -> None:
        await self.refuse()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._pipes.add(writer)
        await self._flowing.wait()  # a black hole: the handshake happened, nothing else does
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            self._pipes.discard(writer)
            return
        self._pipes.add(up_writer)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await reader.read(65536):
                await self._flowing.wait()
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


async def proxied_amqp(amqp_url: str) -> tuple[TcpProxy, str]:
    """The same for an ``amqp://`` URL."""
    target = urlsplit(amqp_url)
    port = target.port or 5672
    proxy = TcpProxy(port)
    await proxy.start()
    return proxy, amqp_url.replace(f":{port}/", f":{proxy.port}/")
