"""What the worker declares, read back from the broker, and what it does with older queues.

- The delay queues (and a new work queue) are quorum queues with at-least-once
  dead-lettering and ``reject-publish``: read back with ``rabbitmqctl list_queues
  arguments``, so a declaration without them fails here in seconds, not only in the
  slow broker-restart test.
- A work queue declared by an earlier version keeps its arguments (RabbitMQ cannot
  change them) and the worker still starts.
- Old retry queues with a delay no configuration names any more are found by their
  name through the management API, and drained; moving the old dead-letter queue keeps
  the broker's reason (``x-death``), which ``worker dlq`` showed as
  ``broker: unknown in None``.
- The backstop policy command in docs/rabbitmq.md runs on this RabbitMQ (3.10.8 here),
  and matches the work queue only.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.server
import json
import re
import shlex
import threading
from collections.abc import Iterator
from typing import Any

import aio_pika
import pytest

from tests.rabbitmq.rabbit_helpers import (
    credit_registry,
    make_broker,
    publish_raw,
    running,
    take_dead_letters,
)
from tests.support.processes import REPO
from tests.support.rabbitmq import MakeRabbitSettings, arabbitmqctl, rabbitmqctl
from tests.support.waiting import wait_for
from worker.brokers.rabbitmq import (
    DELIVERIES_HEADER,
    RabbitMQAdmin,
    RabbitMQSettings,
    make_identity,
)

pytestmark = [pytest.mark.rabbitmq]

AT_LEAST_ONCE = {"x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"}


async def declared_arguments(vhost: str) -> dict[str, dict[str, str]]:
    """Each queue's arguments as the broker lists them: ``[{"x-queue-type","quorum"},...]``."""
    out = await arabbitmqctl("list_queues", "-q", "-p", vhost, "--no-table-headers", "name",
                             "arguments")  # fmt: skip
    found = {}
    for line in out.splitlines():
        name, _, listed = line.partition("\t")
        found[name] = dict(re.findall(r'\{"([^"]+)",("?[^"}]*"?)\}', listed))
    # an empty string is listed as [] (Erlang's empty binary)
    return {
        name: {k: "" if v == "[]" else v.strip('"') for k, v in args.items()}
        for name, args in found.items()
    }


async def test_delay_queues_and_a_new_work_queue_are_declared_at_least_once(
    rabbit_settings: MakeRabbitSettings, rabbitmq_vhost: str
) -> None:
    rabbit = rabbit_settings(retry_delays=[0.2, 5.0])
    broker = make_broker(rabbit)
    await broker.start(prefetch=1)
    await broker.close()
    arguments = await declared_arguments(rabbitmq_vhost)
    for delay in rabbit.retry_delays:
        declared = arguments[rabbit.retry_queue(delay)]
        assert declared == {
            "x-queue-type": "quorum",
            "x-message-ttl": str(round(delay * 1000)),
            **AT_LEAST_ONCE,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": rabbit.queue,
        }, declared
    assert arguments[rabbit.queue] == {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": rabbit.dead_letter_exchange,
        **AT_LEAST_ONCE,
    }
    assert arguments[rabbit.dead_letter_queue] == {"x-queue-type": "classic"}


@pytest.mark.postgres
async def test_a_work_queue_of_an_earlier_version_keeps_its_arguments_and_the_worker_starts(
    rabbit_settings: MakeRabbitSettings, rabbitmq_vhost: str, pg: str
) -> None:
    rabbit = rabbit_settings()
    earlier: dict[str, Any] = {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": rabbit.dead_letter_exchange,
    }
    connection = await aio_pika.connect(rabbit.url)
    async with connection:
        await (await connection.channel()).declare_queue(
            rabbit.queue, durable=True, arguments=earlier
        )
    registry, _ = credit_registry()
    async with running(rabbit, pg, registry) as pump:
        body = b'{"account_id": "a", "amount": "1"}'
        await publish_raw(rabbit, aio_pika.Message(body, message_id="m1", type="CreditRequested"))
        await wait_for(lambda: pump.stats["committed"] == 1, 10, "the credit")
    assert (await declared_arguments(rabbitmq_vhost))[rabbit.queue] == earlier


# -- older queues --------------------------------------------------------------------------


@contextlib.contextmanager
def management_api(vhost: str, queues: list[str]) -> Iterator[str]:
    """A stand-in for the management plugin's ``GET /api/queues/<vhost>`` (the plugin is
    not enabled on the shared broker here), on loopback; it wants basic auth."""
    expected = "Basic " + base64.b64encode(b"guest:guest").decode()

    class Api(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.headers.get("Authorization") != expected:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="RabbitMQ Management"')
                self.end_headers()
                return
            path = self.path.split("?")[0]
            if path != f"/api/queues/{vhost}":
                self.send_response(404)
                self.end_headers()
                return
            body = json.dumps([{"name": name} for name in queues]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Api)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


async def test_old_retry_queues_of_any_delay_are_found_by_name_and_drained(
    rabbit_settings: MakeRabbitSettings, rabbitmq_vhost: str
) -> None:
    """``Q.retry.600000ms`` (a custom delay of an earlier configuration) kept its message
    and its at-most-once path: only the configured and default delays were looked for."""
    rabbit = rabbit_settings(retry_delays=[0.2, 0.5])
    custom, other = f"{rabbit.queue}.retry.600000ms", f"{rabbit.queue}x.retry.600000ms"
    connection = await aio_pika.connect(rabbit.url)
    async with connection:
        channel = await connection.channel()
        old_arguments: dict[str, Any] = {
            "x-queue-type": "classic",
            "x-message-ttl": 600_000,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": rabbit.queue,
        }
        for name in (custom, other):
            await channel.declare_queue(name, durable=True, arguments=old_arguments)
    body = b'{"account_id": "a", "amount": "1"}'
    waiting = aio_pika.Message(
        body, message_id="waiting", type="CreditRequested", headers={DELIVERIES_HEADER: 1}
    )
    await publish_raw(rabbit, waiting, routing_keys=[custom])
    listed = [custom, other, rabbit.queue, "unrelated.retry.5ms"]
    with management_api(rabbitmq_vhost, listed) as api:
        broker = make_broker(rabbit_settings(retry_delays=[0.2, 0.5], management_url=api))
        await broker.start(prefetch=4)
        try:
            delivery = await asyncio.wait_for(broker.receive(), 10)
            assert (delivery.message_id, delivery.delivery_count) == ("waiting", 2)
            await delivery.ack()
        finally:
            await broker.close()
    assert broker.stats["legacy_messages_moved"] == 1
    names = set(await declared_arguments(rabbitmq_vhost))
    assert custom not in names  # drained and deleted
    assert other in names  # another worker's queue: not ours to touch


async def test_moving_the_old_dead_letter_queue_keeps_the_brokers_reason(
    rabbit_settings: MakeRabbitSettings,
) -> None:
    rabbit = rabbit_settings()
    legacy_dead, source = f"{rabbit.queue}.dead", f"{rabbit.queue}.old-source"
    connection = await aio_pika.connect(rabbit.url)
    async with connection:
        channel = await connection.channel()
        dlx = await channel.declare_exchange(
            rabbit.dead_letter_exchange, aio_pika.ExchangeType.FANOUT, durable=True
        )
        dead = await channel.declare_queue(
            legacy_dead, durable=True, arguments={"x-queue-type": "quorum"}
        )
        await dead.bind(dlx, "")
        # the broker dead-letters this one itself: its TTL runs out at once
        await channel.declare_queue(source, durable=True, arguments={
            "x-message-ttl": 1, "x-dead-letter-exchange": rabbit.dead_letter_exchange})  # fmt: skip
    await publish_raw(rabbit, aio_pika.Message(b"{}", message_id="expired"), routing_keys=[source])

    async def arrived() -> bool:
        out = await arabbitmqctl(
            "list_queues", "-q", "-p", rabbit_vhost(rabbit), "name", "messages"
        )
        return f"{legacy_dead}\t1" in out

    await wait_for(arrived, 10, "the broker's dead letter in the old queue")
    broker = make_broker(rabbit)
    await broker.start(prefetch=1)
    await broker.close()
    admin = RabbitMQAdmin(rabbit, make_identity(rabbit))
    try:
        (letter,) = await admin.dead_letters(10)
    finally:
        await admin.close()
    assert (letter.message_id, letter.reason) == ("expired", f"broker: expired in {source}")
    assert letter.dead_lettered_at is not None
    (taken,) = await take_dead_letters(rabbit)
    deaths = taken.headers["x-death"]
    assert isinstance(deaths, list) and isinstance(deaths[0], dict)
    assert deaths[0]["queue"] == source


def rabbit_vhost(rabbit: RabbitMQSettings) -> str:
    return rabbit.url.rsplit("/", 1)[1]


# -- the backstop policy of docs/rabbitmq.md -----------------------------------------------


def documented_policy_command() -> list[str]:
    """The ``rabbitmqctl set_policy`` command docs/rabbitmq.md gives for the backstop."""
    text = (REPO / "docs" / "rabbitmq.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    (block,) = [b for b in blocks if "set_policy" in b and "delivery-limit" in b]
    return shlex.split(block.replace("\\\n", " "))


def test_the_documented_backstop_policy_is_accepted_and_matches_the_work_queue_only(
    rabbit_settings: MakeRabbitSettings, rabbitmq_vhost: str
) -> None:
    rabbit = rabbit_settings(retry_delays=[0.2])
    asyncio.run(_start_and_stop(rabbit))
    command = [
        part.replace("billing-credits", rabbit.queue) for part in documented_policy_command()
    ]
    assert command[:2] == ["rabbitmqctl", "set_policy"], command
    assert command[command.index("--vhost") + 1] == "billing", command
    command[command.index("--vhost") + 1] = vhost = rabbitmq_vhost
    rabbitmqctl(*command[1:])  # raises on a refusal ("apply-to 'quorum_queues' unrecognised")
    name = command[-3]
    try:
        out = rabbitmqctl("list_queues", "-q", "-p", vhost, "--no-table-headers", "name", "policy")
        policies = dict(line.split("\t") for line in out.splitlines() if "\t" in line)
        assert policies[rabbit.queue] == name
        assert policies[rabbit.dead_letter_queue] == ""
        assert policies[rabbit.retry_queue(0.2)] == ""
        definition = json.loads(command[-1])
        assert definition["delivery-limit"] > 5  # above WORKER_MAX_DELIVERIES' default
    finally:
        rabbitmqctl("clear_policy", "-p", vhost, name)


async def _start_and_stop(rabbit: RabbitMQSettings) -> None:
    broker = make_broker(rabbit)
    await broker.start(prefetch=1)
    await broker.close()
