"""``worker demo``'s events table: the outbox yields one event id per applied credit."""

from __future__ import annotations

import pytest

from worker.demo import events_demo, make_stream


async def test_the_outbox_yields_exactly_one_event_id_per_applied_credit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert await events_demo(make_stream(120))
    table = capsys.readouterr().out
    lost = next(line for line in table.splitlines() if line.startswith("applied, no event"))
    never = next(line for line in table.splitlines() if line.startswith("event, never applied"))
    assert lost.split()[-1] == "0" and never.split()[-1] == "0"  # the outbox column
    assert int(lost.split()[-2]) > 0  # after commit: a crash lost events
    assert int(never.split()[-3]) > 0  # in handler: events for credits never applied
