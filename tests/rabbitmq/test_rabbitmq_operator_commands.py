"""``worker publish`` and ``worker dlq`` change or invent nothing they were not asked to.

- A typo in WORKER_RABBITMQ_QUEUE (or _EXCHANGE) is a one-line error, and nothing is
  declared: before, ``worker dlq`` declared six queues and an exchange, and bound the
  typo queue to the shared exchange with ``#``, so every message from then on was also
  copied into a queue nobody reads.
- ``worker publish`` refuses a line without an id unless asked (a re-run after a partial
  failure would apply it twice under a new invented id), checks the whole input before
  sending, and when the broker refuses one message says exactly which lines went out.
- A dead letter whose message had no id stays "no id": aiormq stamps a random
  ``message_id`` on every copy it publishes, so the listing showed ids that never
  existed, and re-submitting applied the messages under them.
- ``worker dlq --resubmit`` acks a dead letter only once its copy is confirmed: when the
  copy is refused, returned or never confirmed, the dead letter is still in ``Q.dlq``.
- ``worker dlq --resubmit --dry-run`` says when ``--limit`` cut what matched.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import aio_pika
import pytest

from tests.rabbitmq.rabbit_helpers import (
    all_depths,
    credit_registry,
    declare,
    depths,
    publish_raw,
    rabbit_env,
    running,
)
from tests.support.database import fetch
from tests.support.processes import arun_cli
from tests.support.rabbitmq import MakeRabbitSettings, arabbitmqctl
from tests.support.waiting import wait_for
from worker.brokers.rabbitmq import REASON_HEADER, RabbitMQAdmin, RabbitMQSettings, make_identity
from worker.errors import BrokerUnavailable

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]


def one_line(result: Any, code: int, *expected: str) -> str:
    assert result.returncode == code, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return str(lines[0])


async def names(vhost: str, what: str, *columns: str) -> list[list[str]]:
    out = await arabbitmqctl(what, "-q", "-p", vhost, "--no-table-headers", *columns)
    return [line.split("\t") for line in out.splitlines() if line.strip()]


# -- a typo declares nothing ---------------------------------------------------------------


@pytest.mark.parametrize(
    "command", [("dlq",), ("dlq", "--resubmit"), ("dlq", "--group-by", "type")]
)
async def test_a_typo_queue_is_one_line_and_nothing_is_declared(
    command: tuple[str, ...], rabbit_settings: MakeRabbitSettings, rabbitmq_vhost: str, pg: str
) -> None:
    real = rabbit_settings()
    await declare(real)  # the worker's topology, its exchange shared
    typo = f"typo-{uuid.uuid4().hex[:6]}"
    env = rabbit_env(real, pg, WORKER_RABBITMQ_QUEUE=typo)
    line = one_line(await arun_cli(env, *command), 2, f"WORKER_RABBITMQ_QUEUE='{typo}'")
    assert "does not exist" in line and "nothing was declared" in line
    assert not [q for q, *_ in await names(rabbitmq_vhost, "list_queues", "name") if typo in q]
    assert not [e for e, *_ in await names(rabbitmq_vhost, "list_exchanges", "name") if typo in e]
    bindings = await names(rabbitmq_vhost, "list_bindings", "source_name", "destination_name")
    assert not [b for b in bindings if any(typo in part for part in b)]


async def test_publish_to_a_typo_exchange_is_one_line_and_declares_nothing(
    rabbit_settings: MakeRabbitSettings, rabbitmq_vhost: str, pg: str
) -> None:
    real = rabbit_settings()
    await declare(real)
    typo = f"typo-{uuid.uuid4().hex[:6]}"
    env = rabbit_env(real, pg, WORKER_RABBITMQ_EXCHANGE=typo)
    line = json.dumps({"id": "m1", "type": "CreditRequested", "body": {}})
    result = await arun_cli(env, "publish", "-", stdin=line + "\n")
    one_line(result, 2, f"WORKER_RABBITMQ_EXCHANGE='{typo}'", "does not exist")
    assert not [e for e, *_ in await names(rabbitmq_vhost, "list_exchanges", "name") if typo in e]
    assert set((await all_depths(real)).values()) == {0}


# -- worker publish: ids, the whole input first, exactly which lines went out -------------------


def jsonl(*items: dict[str, Any]) -> str:
    return "".join(json.dumps(item) + "\n" for item in items)


def credit_line(message_id: str | None, kind: str = "CreditRequested") -> dict[str, Any]:
    item: dict[str, Any] = {"type": kind, "body": {"account_id": "a", "amount": "1"}}
    if message_id is not None:
        item["id"] = message_id
    return item


async def test_publish_refuses_a_line_without_an_id_unless_asked(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    rabbit = rabbit_settings()
    await declare(rabbit)
    env = rabbit_env(rabbit, pg)
    lines = jsonl(credit_line("m1"), credit_line(None), credit_line("m3"))
    refused = await arun_cli(env, "publish", "-", stdin=lines)
    one_line(refused, 2, "line 2", 'no "id"', "--allow-missing-ids", "nothing was sent")
    assert (await depths(rabbit, rabbit.queue))[rabbit.queue] == 0  # not even line 1

    allowed = await arun_cli(env, "publish", "--allow-missing-ids", "-", stdin=lines)
    assert allowed.returncode == 0, allowed.stderr
    await wait_for(lambda: _depth_is(rabbit, 3), 10, "the three messages, the id-less one included")


async def _depth_is(rabbit: RabbitMQSettings, expected: int) -> bool:
    return (await depths(rabbit, rabbit.queue))[rabbit.queue] == expected


@pytest.mark.parametrize(
    "bad",
    [{"id": 7, "type": "CreditRequested", "body": {}}, {"id": "x", "type": "", "body": {}}],
    ids=["a number for an id", "an empty type"],
)
async def test_publish_checks_every_line_before_sending_anything(
    bad: dict[str, Any], rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    rabbit = rabbit_settings()
    await declare(rabbit)
    lines = jsonl(*(credit_line(f"m{n}") for n in range(35)), bad)
    result = await arun_cli(rabbit_env(rabbit, pg), "publish", "-", stdin=lines)
    one_line(result, 2, "line 36", "nothing was sent")
    assert (await depths(rabbit, rabbit.queue))[rabbit.queue] == 0


async def test_a_refused_message_stops_publish_naming_the_lines_that_went_out(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    rabbit = rabbit_settings(binding_keys=["CreditRequested"])
    await declare(rabbit)
    lines = jsonl(
        credit_line("m1"),
        credit_line("m2"),
        credit_line("r3", "RefundRequested"),
        credit_line("m4"),
    )
    result = await arun_cli(rabbit_env(rabbit, pg), "publish", "-", stdin=lines)
    line = one_line(result, 2, "reaches no queue", "confirmed 3 of 4 messages")
    assert "input lines 1-2,4 went out" in line
    assert (await depths(rabbit, rabbit.queue))[rabbit.queue] == 3


# -- dead letters without an id ----------------------------------------------------------------


def publish_without_an_id(rabbit: RabbitMQSettings, body: bytes) -> None:
    """What a producer that is not aio-pika sends: a message with no message_id at all
    (aiormq would stamp a random one on anything it publishes)."""
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(rabbit.url))
    try:
        channel = connection.channel()
        properties = pika.BasicProperties(type="CreditRequested", delivery_mode=2)
        channel.basic_publish(rabbit.exchange, "CreditRequested", body, properties)
    finally:
        connection.close()


async def test_dead_letters_without_an_id_stay_no_id_and_are_not_resubmitted_by_default(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    rabbit = rabbit_settings()
    await declare(rabbit)
    env = rabbit_env(rabbit, pg)
    body = b'{"account_id": "a", "amount": "5"}'
    for _ in range(3):
        await asyncio.to_thread(publish_without_an_id, rabbit, body)
    registry, _ = credit_registry()
    async with running(rabbit, pg, registry) as pump:
        await wait_for(lambda: pump.stats["dead-letter"] == 3, 10, "three dead letters")

    listed = await arun_cli(env, "dlq")
    assert listed.returncode == 0, listed.stderr
    letters = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(letter["id"], letter["reason"]) for letter in letters] == [(None, "no message id")] * 3

    kept = await arun_cli(env, "dlq", "--resubmit")
    assert kept.returncode == 0, kept.stderr
    assert "re-submitted 0 dead letters" in kept.stderr
    assert "left out 3 dead letters without a message id" in kept.stderr
    queues = await all_depths(rabbit)
    assert (queues[rabbit.queue], queues[rabbit.dead_letter_queue]) == (0, 3)

    # asked for: moved, and still without an id, so never applied under an invented one
    moved = await arun_cli(env, "dlq", "--resubmit", "--include-no-id")
    assert moved.returncode == 0, moved.stderr
    assert "re-submitted 3 dead letters" in moved.stderr
    async with running(rabbit, pg, registry) as pump:
        await wait_for(lambda: pump.stats["dead-letter"] == 3, 10, "dead-lettered again")
    assert pump.stats["committed"] == 0
    assert await fetch(pg, "SELECT id, balance FROM accounts") == []


# -- --resubmit acks a dead letter only after its copy is confirmed -----------------------------


async def dead_letter(rabbit: RabbitMQSettings, *ids: str) -> None:
    connection = await aio_pika.connect(rabbit.url)
    async with connection:
        channel = await connection.channel()
        dlx = await channel.get_exchange(rabbit.dead_letter_exchange)
        for message_id in ids:
            reason = "credit: RuntimeError: ledger down"
            message = aio_pika.Message(
                b"{}", message_id=message_id, headers={REASON_HEADER: reason}
            )
            await dlx.publish(message, routing_key="")


async def refuse_every_publish_to(rabbit: RabbitMQSettings, vhost: str, queue: str) -> str:
    """A max-length policy with reject-publish: the broker nacks every publish to ``queue``
    (a quorum queue's limit is soft, so one filler message makes it bite)."""
    await publish_raw(rabbit, aio_pika.Message(b"filler", message_id="filler"))
    name = f"{queue}-full"
    definition = json.dumps({"max-length": 0, "overflow": "reject-publish"})
    pattern = f"^{queue}$"
    await arabbitmqctl("set_policy", "-p", vhost, "--apply-to", "queues", name, pattern, definition)

    async def applied() -> bool:
        rows = await names(vhost, "list_queues", "name", "policy")
        return [queue, name] in rows

    await wait_for(applied, 15, "the reject-publish policy to apply")
    return name


CASES = ["publish-refused", "work-queue-gone", "confirm-timeout"]


@pytest.mark.parametrize("case", CASES)
async def test_a_resubmit_whose_copy_fails_leaves_the_dead_letter_in_place(
    case: str,
    rabbit_settings: MakeRabbitSettings,
    rabbitmq_vhost: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rabbit = rabbit_settings(settle_timeout=1.0)
    await declare(rabbit)
    await dead_letter(rabbit, "d1", "d2")
    admin = RabbitMQAdmin(rabbit, make_identity(rabbit))
    policy = None
    try:
        if case == "publish-refused":
            policy = await refuse_every_publish_to(rabbit, rabbitmq_vhost, rabbit.queue)
        elif case == "work-queue-gone":  # deleted after the tool found it: the copy returns
            publish = aio_pika.exchange.Exchange.publish

            async def after_deleting(exchange: Any, *args: Any, **kwargs: Any) -> Any:
                connection = await aio_pika.connect(rabbit.url)
                async with connection:
                    await (await connection.channel()).queue_delete(rabbit.queue)
                return await publish(exchange, *args, **kwargs)

            monkeypatch.setattr(aio_pika.exchange.Exchange, "publish", after_deleting)
        else:

            async def never_confirmed(*_: Any, **__: Any) -> None:
                await asyncio.Event().wait()

            monkeypatch.setattr(aio_pika.exchange.Exchange, "publish", never_confirmed)
        with pytest.raises(BrokerUnavailable, match="0 moved before, the rest are still in"):
            await asyncio.wait_for(admin.resubmit(10), 20)
    finally:
        await admin.close()
        if policy is not None:
            await arabbitmqctl("clear_policy", "-p", rabbitmq_vhost, policy)
    assert (await depths(rabbit, rabbit.dead_letter_queue))[rabbit.dead_letter_queue] == 2


# -- --dry-run says when --limit cut what matched --------------------------------------------


async def test_a_dry_run_says_when_the_limit_cut_the_matching_dead_letters(
    rabbit_settings: MakeRabbitSettings, pg: str
) -> None:
    rabbit = rabbit_settings()
    await declare(rabbit)
    await dead_letter(rabbit, *(f"d{n}" for n in range(17)))
    env = rabbit_env(rabbit, pg)
    cut = await arun_cli(
        env, "dlq", "--reason", "ledger", "--resubmit", "--dry-run", "--limit", "5"
    )
    assert cut.returncode == 0, cut.stderr
    assert len(cut.stdout.splitlines()) == 5
    assert "would re-submit 5 of 17 matching dead letters found (--limit 5 cut the rest" in (
        cut.stderr
    )
    whole = await arun_cli(env, "dlq", "--resubmit", "--dry-run", "--limit", "50")
    assert "would re-submit 17 dead letters" in whole.stderr and "cut" not in whole.stderr
    assert (await depths(rabbit, rabbit.dead_letter_queue))[rabbit.dead_letter_queue] == 17
