"""What a pump holds, measured without naming any of its attributes.

The walk starts at the :class:`~worker.pump.Pump` and follows ``gc.get_referents`` through
every object the pump can reach, adding up the lengths of the containers it meets (dicts,
sets, lists, deques, Counters: whatever the pump keeps per delivery lives in one of them).
It does not enter what the pump was given and does not own (the broker connection, the
engine, the registry, the settings, the event loop, the process's log configuration), nor
code and modules (a function's globals would reach the whole program), nor running stacks
(tasks, coroutines and their frames: what a worker holds between two awaits is in flight,
not at rest). A pump at rest
must measure the same after twenty messages and after two thousand: DESIGN rule 17.
"""

from __future__ import annotations

import asyncio
import enum
import gc
import sys
import types
from collections import deque
from collections.abc import Iterable

_CONTAINERS = (dict, set, frozenset, list, deque)
_OPAQUE = (
    type,
    types.ModuleType,
    types.CodeType,
    types.FrameType,
    types.CoroutineType,
    types.GeneratorType,
    types.AsyncGeneratorType,
    types.BuiltinFunctionType,
    asyncio.Future,  # tasks too: a running stack, not a structure at rest
    asyncio.AbstractEventLoop,
    enum.Enum,  # a tally keyed by an enum member: the member is the module's, not the pump's
)
_PROCESS_WIDE = ("structlog", "logging")
"""Modules whose objects belong to the process, not the pump: the log's configuration (a
test that captures the log holds every entry there)."""


def footprint(root: object, outside: Iterable[object] = ()) -> int:
    """The summed lengths of every container reachable from ``root`` without passing
    through ``outside`` (objects the root was given, not its own)."""
    stop = {id(obj) for obj in outside}
    stop.update(id(vars(module)) for module in list(sys.modules.values()) if module is not None)
    seen: set[int] = set()
    total = 0
    todo: list[object] = [root]
    while todo:
        obj = todo.pop()
        key = id(obj)
        if key in seen or key in stop:
            continue
        seen.add(key)
        if isinstance(obj, _OPAQUE) or type(obj).__module__.startswith(_PROCESS_WIDE):
            continue
        if isinstance(obj, types.FunctionType):
            # a closure's cells are state; its globals are the module's, not the pump's
            todo.extend(cell.cell_contents for cell in obj.__closure__ or () if _filled(cell))
            todo.extend(obj.__defaults__ or ())
            continue
        if isinstance(obj, _CONTAINERS):
            total += len(obj)
        todo.extend(gc.get_referents(obj))
    return total


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True
