"""Each replica of each run gets the handler modules' state of its own: data is copied
from what the module held when the check began, functions are rebound to the copy, and a
module the handlers' module uses is copied with it; objects stay shared."""

from __future__ import annotations

import itertools
from decimal import Decimal
from typing import Any

import httpx

from tests.testing import evaluation, evaluation_prices
from worker.testing.isolation import Isolation, changes

MODULE = "tests.testing.evaluation"


def namespace(replica: Any, name: str = MODULE) -> dict[str, Any]:
    found: dict[str, Any] = replica.namespaces[name]
    return found


def test_each_replica_has_its_own_copy_of_the_data() -> None:
    isolation = Isolation(evaluation.SEEN_IDS)
    first, second = isolation.replica(), isolation.replica()
    namespace(first)["_SEEN"].add("m-1")
    assert namespace(second)["_SEEN"] == set()
    assert set() == evaluation._SEEN  # the module itself is never written
    assert "_SEEN" in isolation.modules[MODULE].state


def test_the_handler_and_its_helpers_read_the_replicas_copy() -> None:
    replica = Isolation(evaluation.CONFIG_CACHE).replica()
    [handler] = list(replica.registry)
    assert handler.func.__globals__ is namespace(replica)
    assert namespace(replica)["_rate"].__globals__ is namespace(replica)
    assert namespace(replica)["_rate"]("DE") == Decimal("0.19")
    assert namespace(replica)["_RATES"] == evaluation._DEFAULT_RATES  # filled in the copy
    assert evaluation._RATES == {}


def test_a_counter_starts_where_the_check_began() -> None:
    isolation = Isolation(evaluation.INVOICE_NUMBERS)
    first, second = isolation.replica(), isolation.replica()
    assert next(namespace(first)["_NUMBERS"]) == next(namespace(second)["_NUMBERS"])
    assert isinstance(evaluation._NUMBERS, itertools.count)


def test_a_module_the_handlers_use_is_copied_with_them() -> None:
    isolation = Isolation(evaluation.HELPER_CACHE)
    replica = isolation.replica()
    helper = namespace(replica, "tests.testing.evaluation_prices")
    seen_from_handlers = namespace(replica)["evaluation_prices"]
    assert seen_from_handlers.__dict__ is helper  # `import ... as` reaches the copy
    seen_from_handlers.remember("p-1", "12.00")
    assert helper["PRICES"] == {"p-1": "12.00"}
    assert evaluation_prices.PRICES == {}
    assert namespace(isolation.replica(), "tests.testing.evaluation_prices")["PRICES"] == {}


def test_what_a_stage_changed_is_named() -> None:
    replica = Isolation(evaluation.SEEN_IDS).replica()
    before = replica.fingerprint()
    namespace(replica)["_SEEN"].add("m-1")
    assert changes(before, replica.fingerprint()) == [f"{MODULE}._SEEN"]
    replica.forget()
    assert namespace(replica)["_SEEN"] == set()


async def test_a_client_made_lazily_is_kept_for_the_runs_after() -> None:
    isolation = Isolation(evaluation.MODULE_CLIENT)
    first = isolation.replica()
    assert namespace(first)["_client"] is None
    client = namespace(first)["_payments"]()
    assert isinstance(client, httpx.AsyncClient)
    first.keep()
    try:
        assert evaluation._client is client  # back in the module, as one process keeps it
        assert namespace(isolation.replica())["_client"] is client
    finally:
        await evaluation.close_clients()
