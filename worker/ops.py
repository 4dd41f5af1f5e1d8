"""The ops endpoint: ``/healthz``, ``/readyz`` and ``/metrics`` (aiohttp, on its own thread).

- ``/healthz`` (liveness): 200 while the worker's event loop keeps turning. A task
  on the worker's loop stamps a heartbeat; when the stamp is older than
  ``WORKER_OPS_STALL_TIMEOUT`` (a handler calling blocking code, a busy loop), the
  probe answers 503 and says for how long the loop has been stuck, and Kubernetes
  restarts the pod.
- ``/readyz`` (readiness): 200 while the pump is ready: broker connected and
  consuming, database available, not shutting down. A SIGTERM turns it 503 at once,
  while in-flight deliveries are still being finished.
- ``/metrics``: the Prometheus exposition of the default registry
  (:mod:`worker.metrics`), in OpenMetrics when the scraper asks for it. With the
  endpoint comes the inbox health monitor: a few bounded queries every
  ``WORKER_INBOX_METRICS_INTERVAL`` seconds (30), never one per scrape.

Why a thread: served from the worker's own loop, a stuck loop could not answer
the liveness probe at all (a timeout says nothing about why), and metrics would
vanish exactly when they are needed. The server thread reads the pump's state,
never changes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Protocol

from aiohttp import web
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import choose_encoder

from worker.errors import ConfigurationError
from worker.logs import get_logger
from worker.metrics import INBOX_POLL_INTERVAL, InboxMonitor
from worker.settings import Settings

HEALTHZ, READYZ, METRICS = "/healthz", "/readyz", "/metrics"
_START_TIMEOUT = 10.0
_STOP_TIMEOUT = 5.0


class Readiness(Protocol):
    """What the ops endpoint asks: the :class:`~worker.pump.Pump` is one."""

    @property
    def ready(self) -> bool: ...


class OpsServer:
    """Serve the probes and metrics for ``target`` until :meth:`stop`."""

    def __init__(
        self,
        target: Readiness,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        stall_timeout: float = 10.0,
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        self.target = target
        self.host = host
        self.port = port  # the bound port once started (useful with port 0)
        self.stall_timeout = stall_timeout
        self.registry = registry
        self._beat_interval = min(1.0, stall_timeout / 4)
        self._last_beat = time.monotonic()
        self._heart: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._log = get_logger(component="ops")
        self.monitor: InboxMonitor | None = None  # stopped with the server

    # -- lifecycle (called on the worker's loop) ----------------------------------

    async def start(self) -> None:
        """Start the heartbeat and the server thread; return once it listens."""
        self._last_beat = time.monotonic()
        self._heart = asyncio.create_task(self._beat(), name="ops-heartbeat")
        self._thread = threading.Thread(target=self._serve, name="worker-ops", daemon=True)
        self._thread.start()
        started = await asyncio.to_thread(self._started.wait, _START_TIMEOUT)
        if self._error is not None or not started:
            await self._cancel_heart()
            why = self._error or TimeoutError(f"not listening after {_START_TIMEOUT}s")
            raise ConfigurationError(
                f"WORKER_OPS_PORT={self.port}: cannot listen on {self.host}: {why}"
            )
        self._log.info("ops endpoint listening", host=self.host, port=self.port)

    async def stop(self) -> None:
        """Stop serving (after the pump: probes answer until the very end)."""
        if self._loop is not None and self._stopping is not None:
            with contextlib.suppress(RuntimeError):  # its loop already ended
                self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, _STOP_TIMEOUT)
        await self._cancel_heart()
        if self.monitor is not None:
            await self.monitor.stop()

    async def _cancel_heart(self) -> None:
        if self._heart is not None:
            self._heart.cancel()
            await asyncio.gather(self._heart, return_exceptions=True)

    async def _beat(self) -> None:
        while True:
            self._last_beat = time.monotonic()
            await asyncio.sleep(self._beat_interval)

    # -- the server thread ------------------------------------------------------

    def _serve(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported to start(); the thread just ends
            self._error = exc
        finally:
            self._started.set()

    async def _main(self) -> None:
        app = web.Application()
        app.router.add_get(HEALTHZ, self._healthz)
        app.router.add_get(READYZ, self._readyz)
        app.router.add_get(METRICS, self._metrics)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
            await site.start()
            self.port = runner.addresses[0][1]
            self._stopping = asyncio.Event()
            self._loop = asyncio.get_running_loop()
            self._started.set()
            await self._stopping.wait()
        finally:
            await runner.cleanup()

    # -- handlers (run on the server thread) -------------------------------------

    def stalled_for(self) -> float:
        """Seconds since the worker's loop last turned (0 while it is healthy)."""
        return max(0.0, time.monotonic() - self._last_beat - self._beat_interval)

    async def _healthz(self, _request: web.Request) -> web.Response:
        stalled = self.stalled_for()
        if stalled > self.stall_timeout:
            return web.json_response(
                {"alive": False, "reason": f"event loop stalled for {stalled:.1f}s"}, status=503
            )
        return web.json_response({"alive": True})

    async def _readyz(self, _request: web.Request) -> web.Response:
        target = self.target
        ready = bool(target.ready)
        body: dict[str, bool] = {"ready": ready}
        broker = getattr(target, "broker", None)
        health = getattr(target, "health", None)
        if broker is not None:
            body["broker"] = bool(broker.ready)
        if health is not None:
            body["database"] = bool(health.available)
        running = getattr(target, "running", None)
        if running is not None:
            body["running"] = bool(running)
        return web.json_response(body, status=200 if ready else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        body = encoder(self.registry)
        return web.Response(body=body, headers={"Content-Type": content_type})


async def start_ops(settings: Settings, target: Readiness) -> OpsServer | None:
    """Start the endpoint when ``WORKER_OPS_PORT`` is set; ``None`` when it is off."""
    if settings.ops_port is None:
        return None
    server = OpsServer(
        target,
        host=settings.ops_host,
        port=settings.ops_port,
        stall_timeout=settings.ops_stall_timeout,
    )
    await server.start()
    # A settings field (WORKER_INBOX_METRICS_INTERVAL) when there is one; 30 s otherwise.
    interval = float(getattr(settings, "inbox_metrics_interval", INBOX_POLL_INTERVAL))
    if interval > 0:
        server.monitor = InboxMonitor(settings.database_url, settings.retention, interval)
        await server.monitor.start()
    return server
