"""The ops endpoint: ``/healthz``, ``/readyz`` and ``/metrics``, on a thread of its own.

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
  endpoint comes the inbox health monitor: a few bounded queries every 30 seconds
  (``INBOX_POLL_INTERVAL``; not a setting), never one per scrape.

Why a thread: served from the worker's own loop, a stuck loop could not answer
the liveness probe at all (a timeout says nothing about why), and metrics would
vanish exactly when they are needed. The server thread reads the pump's state,
never changes it. It is the standard library's threading HTTP server: three GET
routes need no framework, and one would cost the worker about 11 MB of RSS.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import choose_encoder

from worker.errors import ConfigurationError
from worker.logs import get_logger
from worker.metrics import INBOX_POLL_INTERVAL, InboxMonitor
from worker.settings import Settings

HEALTHZ, READYZ, METRICS = "/healthz", "/readyz", "/metrics"
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
        self._server: ThreadingHTTPServer | None = None
        self._log = get_logger(component="ops")
        self.monitor: InboxMonitor | None = None  # stopped with the server

    # -- lifecycle (called on the worker's loop) ----------------------------------

    async def start(self) -> None:
        """Start the heartbeat and the server thread; return once it listens."""
        try:
            self._server = _Server((self.host, self.port), self)
        except OSError as exc:
            raise ConfigurationError(
                f"WORKER_OPS_PORT={self.port}: cannot listen on {self.host}: {exc}"
            ) from None
        self.port = self._server.server_address[1]
        self._last_beat = time.monotonic()
        self._heart = asyncio.create_task(self._beat(), name="ops-heartbeat")
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.5,), name="worker-ops", daemon=True
        )
        self._thread.start()
        self._log.info("ops endpoint listening", host=self.host, port=self.port)

    async def stop(self) -> None:
        """Stop serving (after the pump: probes answer until the very end)."""
        server, self._server = self._server, None
        if server is not None:
            await asyncio.to_thread(server.shutdown)  # waits for serve_forever to return
            server.server_close()
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

    # -- answers (on the server thread) -----------------------------------------

    def stalled_for(self) -> float:
        """Seconds since the worker's loop last turned (0 while it is healthy)."""
        return max(0.0, time.monotonic() - self._last_beat - self._beat_interval)

    def healthz(self) -> tuple[int, dict[str, Any]]:
        stalled = self.stalled_for()
        if stalled > self.stall_timeout:
            return 503, {"alive": False, "reason": f"event loop stalled for {stalled:.1f}s"}
        return 200, {"alive": True}

    def readyz(self) -> tuple[int, dict[str, Any]]:
        target = self.target
        ready = bool(target.ready)
        body: dict[str, Any] = {"ready": ready}
        broker = getattr(target, "broker", None)
        health = getattr(target, "health", None)
        if broker is not None:
            body["broker"] = bool(broker.ready)
        if health is not None:
            body["database"] = bool(health.available)
        consuming = getattr(target, "consuming", None)
        if consuming is not None:
            body["running"] = bool(consuming)
        return (200 if ready else 503), body


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a scrape in progress never holds the worker's exit
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], ops: OpsServer) -> None:
        self.ops = ops
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        ops = self.server.ops
        path = self.path.split("?", 1)[0]
        if path == METRICS:
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            self._send(200, encoder(ops.registry), content_type)
        elif path == HEALTHZ:
            self._json(*ops.healthz())
        elif path == READYZ:
            self._json(*ops.readyz())
        else:
            self._json(404, {"error": f"no such path {path!r}"})

    def _json(self, status: int, body: dict[str, Any]) -> None:
        self._send(status, json.dumps(body).encode(), "application/json; charset=utf-8")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Probes every few seconds are not worth a log line each."""


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
    # A settings field `inbox_metrics_interval` when one exists (none does today); 30 s.
    interval = float(getattr(settings, "inbox_metrics_interval", INBOX_POLL_INTERVAL))
    if interval > 0:
        server.monitor = InboxMonitor(settings.database_url, settings.inbox_kept_for, interval)
        await server.monitor.start()
    return server
