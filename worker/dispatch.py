"""The innermost step of a unit of work: its start, then each handler's runner in order.

A unit of work's start is where its delivery count is spent (:mod:`worker.attempts`:
durably, for a redelivery, before anything that may crash starts) and where a
delivery past ``WORKER_MAX_DELIVERIES`` ends without running. Then each handler of
the type runs through the stage middleware into the runner it names (batch mode: the
batch runner), over the items still live: an item whose verdict is not an ack stops
there, and the type's later handlers run on its redelivery, the earlier ones being
deduplicated by their markers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

from worker import attempts, inbox
from worker.db import discard
from worker.judge import Again
from worker.middleware import NextStage, StageMiddleware, compose
from worker.registry import Runs
from worker.verdict import Outcome, Verb, Verdict
from worker.work import Stage

if TYPE_CHECKING:
    from worker.endings import Endings
    from worker.registry import Handler
    from worker.settings import Settings
    from worker.work import Item, Work


class Runner(Protocol):
    """What runs one handler over a stage's items: a verdict per item, in order."""

    async def run(self, stage: Stage) -> list[Verdict]: ...


class Dispatch:
    """Starts a unit of work and runs its handlers; every item ends with a verdict."""

    def __init__(
        self,
        engine: AsyncEngine,
        sessions: async_sessionmaker[Any],
        endings: Endings,
        runners: Mapping[Runs, Runner],
        batches: Runner | None,
        settings: Settings,
        outcomes: Counter[tuple[str, str]],
        middleware: Sequence[StageMiddleware] = (),
    ) -> None:
        self._engine = engine
        self._sessions = sessions
        self._endings = endings
        self._settings = settings
        self._outcomes = outcomes
        self._runners = {runs: compose(middleware, runner.run) for runs, runner in runners.items()}
        self._batches: NextStage | None = None
        if batches is not None:
            self._batches = compose(middleware, batches.run)

    async def __call__(self, work: Work) -> None:
        if work.refused:  # dead-lettered before any handler ran: counted under no consumer
            for item in work.items:
                assert item.verdict is not None
                item.consumer = ""
                self._outcomes["", item.verdict.outcome] += 1
            return
        if work.batch:
            await self._start_batch(work)
        else:
            await self._start(work.items[0], work.handlers)
        await self._stages(work)
        for item in work.items:  # the same id twice in a batch: the copy is the first's duplicate
            if item.twins and item.verdict is not None and item.verdict.verb is Verb.ACK:
                self._outcomes[item.consumer or "", Outcome.DUPLICATE] += len(item.twins)

    async def _stages(self, work: Work) -> None:
        live = [item for item in work.items if item.verdict is None]
        last = len(work.handlers) - 1
        for index, handler in enumerate(work.handlers):
            if not live:
                return
            stage = Stage(work, handler, live, last=index == last)
            runner = self._batches if work.batch else self._runners[handler.runs]
            assert runner is not None
            verdicts = await runner(stage)
            still: list[Item] = []
            for item, verdict in zip(live, verdicts, strict=True):
                if item.deferred:
                    continue  # runs again on its own; tallied then
                item.verdict, item.consumer = verdict, handler.consumer
                self._outcomes[handler.consumer, verdict.outcome] += 1
                if verdict.verb is Verb.ACK:
                    still.append(item)
            live = still

    async def _start_batch(self, work: Work) -> None:
        """A batch's starts, in one statement (first deliveries only: none is past a limit)."""
        consumer = work.handlers[0].consumer
        if await attempts.count_many(self._engine, work.deliveries, consumer, self._settings):
            for item in work.items:
                item.counted = consumer

    async def _start(self, item: Item, handlers: tuple[Handler[Any], ...]) -> None:
        """Spend the start durably (redeliveries); past the limit, end it here. A batch
        member that runs again on its own after losing to another writer was counted
        when its batch started."""
        delivery = item.delivery
        consumer = handlers[0].consumer
        if item.counted is None and await attempts.count(
            self._engine, delivery, consumer, self._settings
        ):
            item.counted = consumer
        if delivery.delivery_count > self._settings.max_deliveries:
            item.verdict = await self._over_limit(item, handlers)
            item.consumer = ""
            self._outcomes["", item.verdict.outcome] += 1

    async def _over_limit(self, item: Item, handlers: tuple[Handler[Any], ...]) -> Verdict:
        """Past WORKER_MAX_DELIVERIES: done already (its ack was lost), or dead-letter it."""
        delivery = item.delivery
        judge = self._endings.judge
        marked = [h for h in handlers if h.inbox]
        if marked and len(marked) == len(handlers):
            session = self._sessions()
            try:
                done = [await inbox.seen(session, item.message_id, h.consumer) for h in marked]
            except Exception as exc:
                ending = await self._endings.ended(delivery, marked[0], 1, exc, 0.0)
                if not isinstance(ending, Again) and ending.environment:
                    return ending  # the database is away: back, uncounted, once it answers
                # past the limit whatever the check says: it ends here, as exhausted
            else:
                if all(done):
                    return judge.duplicate(delivery, marked[0].consumer, 0, "fast-path")
            finally:
                await discard(session)
        limit = self._settings.max_deliveries
        reason = f"delivered {delivery.delivery_count} times (WORKER_MAX_DELIVERIES={limit})"
        return Verdict(Verb.DEAD_LETTER, Outcome.EXHAUSTED, reason)
