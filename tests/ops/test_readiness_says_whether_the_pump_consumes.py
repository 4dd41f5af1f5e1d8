"""``/readyz`` says why it is not ready: ``running`` is whether the pump consumes now."""

from __future__ import annotations

import json
import urllib.request
from urllib.error import HTTPError

from pydantic import BaseModel

from tests.support.pumps import RunPump
from worker.ops import READYZ, OpsServer
from worker.registry import Context, Registry


class Note(BaseModel):
    text: str


def _registry() -> Registry:
    registry = Registry()

    @registry.handler("Note", Note, consumer="readyz-note")
    async def note(ctx: Context, message: Note) -> None:
        return None

    return registry


def _readyz(port: int) -> tuple[int, dict[str, bool]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{READYZ}", timeout=5) as response:
            return response.status, json.loads(response.read())
    except HTTPError as error:
        return error.code, json.loads(error.read())


async def test_running_turns_false_once_the_pump_has_stopped(run_pump: RunPump) -> None:
    async with run_pump(_registry()) as (pump, _broker):
        server = OpsServer(pump, port=0)
        await server.start()
        assert _readyz(server.port) == (
            200,
            {"ready": True, "broker": True, "database": True, "running": True},
        )
    try:  # the pump stopped and closed its broker; the endpoint still answers
        status, body = _readyz(server.port)
        assert status == 503
        assert body["ready"] is False
        assert body["running"] is False
    finally:
        await server.stop()
