"""The calls a handler makes are seen where they are made: every request of a client kept
open across messages counts, a safe request is a read, and the idempotency key a call
carries is read from it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from worker.testing import effects
from worker.testing.effects import Effect, header_key
from worker.testing.probe import install


@pytest.fixture
def seen() -> Iterator[list[Effect]]:
    """What the hooks report, instead of the probe; the probe's recorder again after."""
    found: list[Effect] = []
    effects.install(found.append)
    try:
        yield found
    finally:
        install()  # the probe's own recorder


def answer(request: httpx.Request) -> httpx.Response:
    return httpx.Response(202, json={"accepted": True})


async def test_every_request_of_a_client_kept_open_is_seen(seen: list[Effect]) -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        for _ in range(3):  # one connection would do for all three
            await client.post("http://pay.example:8080/charge?x=1", json={"amount": "9.99"})
        await client.get("http://pay.example:8080/charges/1")
    assert seen[:3] == [Effect("request", "POST http://pay.example:8080/charge", None)] * 3
    assert seen[3] == Effect("read", "GET http://pay.example:8080/charges/1", None)
    assert seen[0].address == "pay.example:8080"


def test_a_synchronous_client_is_seen_with_its_key(seen: list[Effect]) -> None:
    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        client.post("https://pay.example/charge", headers={"Idempotency-Key": "k-1"})
    assert seen == [Effect("request", "POST https://pay.example/charge", "k-1")]
    assert seen[0].address == "pay.example:443"
    assert seen[0].host == "request https://pay.example"


def test_a_key_is_read_from_headers_named_like_one() -> None:
    assert header_key({"idempotency-key": "a"}) == "a"
    assert header_key([(b"X-Idempotency-Key", b"b")]) == "b"
    assert header_key({"Idempotency_Key": "c", "other": "d"}) == "c"
    assert header_key({"X-Request-Id": "e"}) is None
    assert header_key(None) is None


async def test_what_a_call_sent_is_kept_for_finding_a_key_in_it(seen: list[Effect]) -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        await client.post("http://pay.example/charge", json={"key": "m-1"}, headers={"X-A": "b"})
    [effect] = seen
    assert effect.key is None
    assert '"key":"m-1"' in effect.content.replace(" ", "") and "b" in effect.content
    assert effect == Effect("request", "POST http://pay.example/charge", None)  # not compared
