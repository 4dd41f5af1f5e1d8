"""Handler registration: one decorator naming the message type and its pydantic model."""

from __future__ import annotations

import enum
import importlib
import os
import sysconfig
import traceback
from collections.abc import Awaitable, Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, overload

from pydantic import BaseModel

from worker.context import BatchContext as BatchContext
from worker.context import Context as Context
from worker.errors import ConfigurationError

M = TypeVar("M", bound=BaseModel)


HandlerFunc = Callable[[Context, M], Awaitable[None]]
BatchHandlerFunc = Callable[[BatchContext, Sequence[M]], Awaitable[None]]


class Runs(enum.Enum):
    """Which runner a handler's deliveries go through (the pump holds one of each)."""

    TRANSACTION = "transaction"
    """worker.transaction: marker and writes in one commit per attempt."""
    CLAIM = "claim"
    """worker.claims: a leased two-phase claim around a call outside the database."""


@dataclass(frozen=True, slots=True)
class Handler(Generic[M]):
    """One registered handler. ``func`` always takes one message; for a batch handler it
    calls ``batch`` with a one-element list, so every per-message path runs it unchanged."""

    message_type: str
    model: type[M]
    func: HandlerFunc[M]
    consumer: str
    inbox: bool
    runs: Runs = Runs.TRANSACTION
    key: Callable[[M], Hashable] | None = None
    batch: BatchHandlerFunc[M] | None = None


class Registry:
    """Message type -> the handlers that consume it, each under its own consumer name."""

    def __init__(self) -> None:
        self._by_type: dict[str, tuple[Handler[Any], ...]] = {}

    @overload
    def handler(
        self,
        message_type: str,
        model: type[M],
        *,
        consumer: str | None = None,
        inbox: bool = True,
        side_effect: bool = False,
        key: Callable[[M], Hashable] | None = None,
        batch: Literal[False] = False,
    ) -> Callable[[HandlerFunc[M]], HandlerFunc[M]]: ...

    @overload
    def handler(
        self,
        message_type: str,
        model: type[M],
        *,
        consumer: str | None = None,
        inbox: bool = True,
        side_effect: bool = False,
        key: Callable[[M], Hashable] | None = None,
        batch: Literal[True],
    ) -> Callable[[BatchHandlerFunc[M]], BatchHandlerFunc[M]]: ...

    def handler(
        self,
        message_type: str,
        model: type[M],
        *,
        consumer: str | None = None,
        inbox: bool = True,
        side_effect: bool = False,
        key: Callable[[M], Hashable] | None = None,
        batch: bool = False,
    ) -> Callable[[Any], Any]:
        """Register ``func`` for ``message_type``.

        ``consumer`` names the inbox marker; it defaults to the function's
        dotted path, so renaming the function renames the consumer (set it
        explicitly in production). ``inbox=False`` opts a handler that is
        idempotent by nature (an upsert of an absolute value) out of the inbox.
        ``side_effect=True`` makes it a two-phase claim handler for calls that
        cannot join the transaction (see :mod:`worker.claims`).

        ``key`` serializes work inside the process: deliveries whose messages map to
        equal keys (``key=lambda m: m.account_id``) run one after another, in the
        order they arrived, while other keys run in parallel. Use it for hot rows:
        writers of one row then queue instead of colliding on its version token.
        Keys are shared across message types, so two types that write the same row
        should return the same key for it.

        ``batch=True`` registers a batch handler, ``async def f(ctx: BatchContext,
        messages: Sequence[Model])``, for set-based SQL over many messages in one
        transaction (a group: WORKER_BATCH_SIZE, docs/batch.md). It is called with a
        one-element list for a delivery that runs alone, and when a failed group falls
        back to one at a time.
        """
        if side_effect and not inbox:
            raise ConfigurationError(f"{message_type}: a side-effect handler needs the inbox")

        def register(func: Any) -> Any:
            name = consumer or f"{func.__module__}.{func.__qualname__}"
            if name in self.consumers():
                raise ConfigurationError(f"consumer name {name!r} is registered twice")
            if batch and (side_effect or key is not None):
                what = "side_effect=True" if side_effect else "key="
                raise ConfigurationError(
                    f"handler {name!r}: batch=True cannot be combined with {what} "
                    "(claims and keyed handlers run one message at a time)"
                )
            one = _one_at_a_time(func) if batch else func
            entry: Handler[M] = Handler(
                message_type,
                model,
                one,
                name,
                inbox,
                Runs.CLAIM if side_effect else Runs.TRANSACTION,
                key,
                func if batch else None,
            )
            self._by_type[message_type] = (*self._by_type.get(message_type, ()), entry)
            return func

        return register

    def for_type(self, message_type: str | None) -> tuple[Handler[Any], ...]:
        if not isinstance(message_type, str):
            return ()
        return self._by_type.get(message_type, ())

    @property
    def keyed(self) -> bool:
        """Whether any handler serializes by key (the pump then prefetches more)."""
        return any(h.key is not None for h in self)

    def consumers(self) -> set[str]:
        return {h.consumer for group in self._by_type.values() for h in group}

    @property
    def message_types(self) -> list[str]:
        return sorted(self._by_type)

    def __iter__(self) -> Iterator[Handler[Any]]:
        return (h for group in self._by_type.values() for h in group)


def _one_at_a_time(batch: BatchHandlerFunc[M]) -> HandlerFunc[M]:
    async def one(context: Context, message: M) -> None:
        await batch(BatchContext.of(context), [message])

    return one


registry = Registry()
"""The default registry that ``@handler`` fills and ``worker run`` serves."""

handler = registry.handler


def import_handlers(modules: Iterable[str]) -> None:
    """Import the modules of WORKER_HANDLERS; one that fails stops the command in one line."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ConfigurationError:
            raise  # the module's own refusal (a setting it loads), already one line
        except Exception as exc:  # a syntax error, or whatever its top level raised
            raise cannot_import(name, exc) from None


def cannot_import(module: str, exc: BaseException) -> ConfigurationError:
    """One line for a handler module that failed to import: what it raised, and the file
    and line it was raised at in the handler author's code (not the import machinery's, nor
    a library's that the module's top level called)."""
    what = " ".join(f"{type(exc).__name__}: {exc}".split())
    where = ""
    if isinstance(exc, SyntaxError):  # its own text carries "(file, line N)" already
        what = f"{type(exc).__name__}: {exc.msg}"
        where = _place(exc.filename, exc.lineno)
    elif not (isinstance(exc, ModuleNotFoundError) and _names_itself(module, exc.name)):
        frame = _authors_frame(traceback.extract_tb(exc.__traceback__))
        where = _place(frame.filename, frame.lineno) if frame else ""
    return ConfigurationError(f"WORKER_HANDLERS: cannot import {module!r}: {what}{where}")


def _names_itself(module: str, missing: str | None) -> bool:
    """Whether the module missing is ``module`` or a package above it: no file to name."""
    return missing is not None and (module == missing or module.startswith(missing + "."))


def _authors_frame(frames: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The deepest frame in the folder of the file the import started in, outside the
    interpreter's and the installed libraries' folders (unless the module lives there)."""
    found = [f for f in frames if not f.filename.startswith(("<frozen", _WORKER_PACKAGE))]
    started = next((f for f in found if f.filename != importlib.__file__), None)
    if started is None:
        return None
    home = os.path.dirname(started.filename) + os.sep
    libraries = tuple(p for p in _LIBRARIES if not home.startswith(p))
    own = [f for f in found if f.filename.startswith(home) and not f.filename.startswith(libraries)]
    return (own or found)[-1]


def _place(filename: str | None, line: int | None) -> str:
    if not filename:
        return ""
    return f" ({filename}, line {line})" if line else f" ({filename})"


_WORKER_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARIES = tuple(
    {os.path.join(sysconfig.get_paths()[name], "") for name in ("stdlib", "purelib", "platlib")}
)
