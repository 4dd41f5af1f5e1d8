"""Module state a handler keeps between messages, given to each replica and each run of a
check of its own, as separate processes would have it.

A check runs its replicas in one process, and many runs one after another. Data a
handler keeps at module level (a dict used as a cache, a set of seen ids, a counter, a
global it rebinds) would then be shared by replicas that in production are separate
processes, and would carry from one run into the next: it hides a defect, or trips one
by accident and blames something else. So each replica of each run gets a copy of every
handler module's namespace: plain data (numbers, strings, and dicts, lists, sets, deques
and counters of them) is copied afresh from what the module held when the check began;
the module's functions, and ``functools.lru_cache`` wrappers of them, are rebound to the
copy. Objects that are not data (a client, an engine, a lock) stay shared, as a process
keeps them, and one a handler creates lazily is kept for the runs after it.

A :class:`Replica` also tells what a stage changed (:meth:`Replica.fingerprint`), and can
forget everything before each stage (``amnesia``): that is how the checker tells whether
a difference comes from state kept in memory.
"""

from __future__ import annotations

import copy
import dis
import functools
import itertools
import sys
import sysconfig
import types
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from enum import Enum
from fractions import Fraction
from pathlib import Path
from typing import Any
from uuid import UUID

from worker.registry import Handler, Registry, Runs

_SCALARS: tuple[type, ...] = (
    *(str, bytes, int, float, bool, Decimal, Fraction, complex, date, datetime, time),
    *(timedelta, UUID, Enum, type(None), itertools.count),
)
_CONTAINERS = (dict, list, set, frozenset, tuple, deque, bytearray)
_MUTABLE: tuple[type, ...] = (dict, list, set, deque, bytearray, itertools.count)
_LIMIT = 10_000  # elements looked at before a container is taken for data anyway
_SHOWN = 20_000  # characters of a value's repr that a fingerprint compares


def is_plain(value: Any, depth: int = 0, budget: list[int] | None = None) -> bool:
    """Data all the way down: scalars, and containers of them."""
    budget = budget if budget is not None else [_LIMIT]
    budget[0] -= 1
    if budget[0] < 0 or depth > 6:
        return False  # too big to copy for every replica of every run: shared
    if isinstance(value, _SCALARS):
        return True
    if isinstance(value, dict):
        return all(
            is_plain(k, depth + 1, budget) and is_plain(v, depth + 1, budget)
            for k, v in value.items()
        )
    if isinstance(value, _CONTAINERS):
        return all(is_plain(item, depth + 1, budget) for item in value)
    return False


def _state(name: str, value: Any) -> bool:
    """Whether a module global is data a handler may keep between messages."""
    if name.startswith("__"):
        return False
    return isinstance(value, _MUTABLE + _SCALARS) and is_plain(value)


def _assigned(namespace: Mapping[str, Any]) -> set[str]:
    """The globals the module's functions assign (``global x; x = ...``): a number or a
    string a function rebinds is state; one nothing rebinds is a constant."""
    found: set[str] = set()
    codes = [
        value.__code__
        for value in namespace.values()
        if isinstance(value, types.FunctionType) and value.__globals__ is namespace
    ]
    while codes:
        code = codes.pop()
        for instruction in dis.get_instructions(code):
            if instruction.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
                found.add(str(instruction.argval))
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return found


def _is_cache(value: Any) -> bool:
    return callable(getattr(value, "cache_clear", None)) and hasattr(value, "__wrapped__")


def _fresh(value: Any, memo: dict[int, Any]) -> Any:
    try:
        return copy.deepcopy(value, memo)  # one memo: a dict two modules hold stays one
    except Exception:  # not copyable after all: shared, as before
        return value


@dataclass(slots=True)
class _Module:
    """One handler module: its live namespace and the names a copy isolates."""

    name: str
    namespace: dict[str, Any]
    state: list[str] = field(default_factory=list)  # data names, copied per replica
    caches: list[str] = field(default_factory=list)  # lru_cache wrappers, new per replica
    shared: list[str] = field(default_factory=list)  # mutable, not plain data: shared
    initial: dict[str, Any] = field(default_factory=dict)  # every global at the start


class Isolation:
    """The handler modules of ``handlers``, ready to be copied per replica."""

    def __init__(self, handlers: Registry) -> None:
        self.handlers = handlers
        self.modules: dict[str, _Module] = {}
        for handler in handlers:
            for func in (handler.func, handler.batch):
                for name in _modules_of(func):
                    if name not in self.modules:
                        self.modules[name] = self._module(name)
        # the application's modules the handlers' modules use (a cache in myapp.cache)
        for name in [n for m in list(self.modules.values()) for n in _used(m.namespace)]:
            if name not in self.modules:
                self.modules[name] = self._module(name)

    @staticmethod
    def _module(name: str) -> _Module:
        namespace = vars(sys.modules[name])
        module = _Module(name, namespace, initial=dict(namespace))
        assigned = _assigned(namespace)
        for key, value in namespace.items():
            if _state(key, value) and (isinstance(value, _MUTABLE) or key in assigned):
                module.state.append(key)
            elif _is_cache(value) and _defined_in(value.__wrapped__, namespace):
                module.caches.append(key)
            elif isinstance(value, _MUTABLE) and not key.startswith("__"):
                module.shared.append(key)
        return module

    def described(self, changed: Iterable[str]) -> list[str]:
        """For the report: the module state the handlers changed, the data each replica and
        run has a copy of, the rest (objects) shared by all."""
        shared = {f"{m.name}.{n}" for m in self.modules.values() for n in m.shared}
        names = list(dict.fromkeys(changed))
        own = [name for name in names if name not in shared]
        common = [name for name in names if name in shared]
        lines = []
        if own:
            lines.append(
                "module state the handlers changed, a copy per replica and run: " + _listed(own)
            )
        if common:
            lines.append(
                "module state the handlers changed, shared by every replica and run (it holds "
                "objects, not data): " + _listed(common)
            )
        return lines

    def replica(self, *, amnesia: bool = False) -> Replica:
        return Replica(self, amnesia=amnesia)


class Replica:
    """One replica's copy of the handler modules, and the registry bound to it."""

    def __init__(self, isolation: Isolation, *, amnesia: bool = False) -> None:
        self.isolation = isolation
        self.amnesia = amnesia
        self.namespaces: dict[str, dict[str, Any]] = {}
        proxies: dict[int, types.ModuleType] = {}  # id of a live module -> its copy
        for name, module in isolation.modules.items():
            proxy = types.ModuleType(name)
            proxy.__dict__.update(module.namespace)
            proxies[id(sys.modules[name])] = proxy
            self.namespaces[name] = proxy.__dict__
        memo: dict[int, Any] = {}
        for module in isolation.modules.values():
            self._restore(module, memo)
        for name, module in isolation.modules.items():
            namespace = self.namespaces[name]
            for key, value in module.namespace.items():
                if isinstance(value, types.FunctionType) and value.__globals__ is module.namespace:
                    namespace[key] = self.rebound(value)
                elif isinstance(value, types.ModuleType) and id(value) in proxies:
                    namespace[key] = proxies[id(value)]  # `import myapp.cache as cache`
            for key in module.caches:
                cached = module.namespace[key]
                parameters = cached.cache_parameters()
                namespace[key] = functools.lru_cache(
                    maxsize=parameters["maxsize"], typed=parameters["typed"]
                )(self.rebound(cached.__wrapped__))
        self.registry = self._registry(isolation.handlers)

    def _restore(self, module: _Module, memo: dict[int, Any]) -> None:
        namespace = self.namespaces[module.name]
        for key in module.state:
            namespace[key] = _fresh(module.initial[key], memo)
        for key in list(_rebound_names(module, namespace)):  # set since: back to its start
            if key in module.initial:
                namespace[key] = module.initial[key]
            else:
                del namespace[key]

    def forget(self) -> None:
        """Back to the state the check began with (``amnesia``: before every stage)."""
        memo: dict[int, Any] = {}
        for module in self.isolation.modules.values():
            self._restore(module, memo)
            for key in module.caches:
                self.namespaces[module.name][key].cache_clear()

    def rebound(self, func: Any, depth: int = 0) -> Any:
        """``func`` reading and writing this replica's copy of its module."""
        if not isinstance(func, types.FunctionType) or depth > 4:
            return func
        namespace = self._namespace_of(func)
        closure = func.__closure__
        if closure is not None:
            cells = []
            for cell in closure:
                try:
                    contents = cell.cell_contents
                except ValueError:  # an empty cell
                    cells.append(cell)
                    continue
                cells.append(types.CellType(self.rebound(contents, depth + 1)))
            closure = tuple(cells)
        if namespace is func.__globals__ and closure == func.__closure__:
            return func
        new = types.FunctionType(
            func.__code__, namespace, func.__name__, func.__defaults__, closure
        )
        new.__kwdefaults__ = copy.copy(func.__kwdefaults__)
        new.__dict__.update(func.__dict__)
        new.__qualname__ = func.__qualname__
        new.__module__ = func.__module__
        new.__doc__ = func.__doc__
        new.__annotations__ = func.__annotations__
        return new

    def _namespace_of(self, func: types.FunctionType) -> dict[str, Any]:
        for name, module in self.isolation.modules.items():
            if func.__globals__ is module.namespace:
                return self.namespaces[name]
        return func.__globals__

    def _registry(self, handlers: Registry) -> Registry:
        registry = Registry()
        for handler in handlers:
            _register(registry, handler, self.rebound)
        return registry

    # -- what a stage changed --------------------------------------------------------

    def fingerprint(self) -> dict[str, str]:
        """Every isolated global's value, as text to compare before and after a stage."""
        found = {}
        for module in self.isolation.modules.values():
            namespace = self.namespaces[module.name]
            for key in (*module.state, *_rebound_names(module, namespace)):
                found[f"{module.name}.{key}"] = _shown(namespace.get(key))
            for key in module.caches:
                info = namespace[key].cache_info()
                found[f"{module.name}.{key}"] = f"lru_cache holding {info.currsize}"
            for key in module.shared:
                found[f"{module.name}.{key}"] = _shown(namespace.get(key))
        return found

    def keep(self) -> None:
        """Objects a handler created lazily (a client kept in a global, an engine kept in a
        dict) go back into the live module, so that later runs share them as one process
        would, and whoever closes them at the end finds them."""
        for module in self.isolation.modules.values():
            namespace = self.namespaces[module.name]
            for key, value in namespace.items():
                if key.startswith("__") or _state(key, value):
                    continue
                if key in module.state and isinstance(value, dict | list | set):
                    _merge(module.namespace.get(key), value)
                    module.state.remove(key)  # it holds objects now: shared from here on
                    module.shared.append(key)
                    continue
                if isinstance(value, types.FunctionType | type | types.ModuleType):
                    continue
                start = module.initial.get(key)
                if value is not start and module.namespace.get(key) is start:
                    module.namespace[key] = module.initial[key] = value
                    if key in module.state:  # None at the start, a client now: shared
                        module.state.remove(key)


def _merge(live: Any, found: dict[Any, Any] | list[Any] | set[Any]) -> None:
    if isinstance(live, dict) and isinstance(found, dict):
        for key, value in found.items():
            live.setdefault(key, value)
    elif isinstance(live, list) and isinstance(found, list):
        live.extend(item for item in found if item not in live)
    elif isinstance(live, set) and isinstance(found, set):
        live.update(found)


def changes(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """The globals whose value a stage changed."""
    return [name for name, shown in after.items() if before.get(name) != shown]


def _rebound_names(module: _Module, namespace: Mapping[str, Any]) -> Iterable[str]:
    """Globals a handler set that held no data at the start (``global x; x = 3``)."""
    for key, value in namespace.items():
        if key in module.state or key.startswith("__"):
            continue
        if value is not module.initial.get(key, _MISSING) and _state(key, value):
            yield key


_MISSING = object()


def _shown(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:
        return f"<{type(value).__name__}>"
    return text[:_SHOWN]


def _listed(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _defined_in(func: Any, namespace: Mapping[str, Any]) -> bool:
    return isinstance(func, types.FunctionType) and func.__globals__ is namespace


def _modules_of(func: Callable[..., Any] | None) -> list[str]:
    """The modules a handler's function (and what it wraps) is defined in, except the
    worker's own."""
    found = []
    seen = 0
    while func is not None and seen < 8:
        seen += 1
        name = getattr(func, "__module__", None)
        if isinstance(name, str) and name in sys.modules and not _is_workers(name):
            found.append(name)
        for cell in getattr(func, "__closure__", None) or ():
            try:
                inner = cell.cell_contents
            except ValueError:
                continue
            if isinstance(inner, types.FunctionType):
                found.extend(n for n in _modules_of(inner) if n not in found)
        func = getattr(func, "__wrapped__", None)
    return found


def _is_workers(name: str) -> bool:
    return name == "worker" or name.startswith("worker.")


_LIBRARIES = tuple(
    str(Path(p).resolve())
    for key in ("stdlib", "platstdlib", "purelib", "platlib")
    if (p := sysconfig.get_paths().get(key))
)


def application_module(module: Any) -> bool:
    """A module of the application's own: from a file outside the standard library and
    the installed packages, and not the worker's."""
    name = getattr(module, "__name__", "")
    file = getattr(module, "__file__", None)
    if not isinstance(name, str) or not file or _is_workers(name) or name not in sys.modules:
        return False
    path = str(Path(file).resolve())
    return not path.startswith(_LIBRARIES)


def _used(namespace: Mapping[str, Any]) -> list[str]:
    """The application's modules a module's globals come from: modules it imports, and
    the modules of the functions and data it imports from them."""
    found = []
    for key, value in namespace.items():
        if key.startswith("__"):
            continue
        if isinstance(value, types.ModuleType):
            module: Any = value
        else:
            module = sys.modules.get(getattr(value, "__module__", None) or "")
            if not isinstance(value, types.FunctionType | type):
                continue
        if module is not None and application_module(module) and module.__name__ not in found:
            found.append(module.__name__)
    return found


def _register(registry: Registry, handler: Handler[Any], rebound: Callable[[Any], Any]) -> None:
    """``handler`` in ``registry`` again, through the public decorator, its function rebound."""
    if handler.batch is not None:
        registry.handler(
            handler.message_type,
            handler.model,
            consumer=handler.consumer,
            inbox=handler.inbox,
            batch=True,
        )(rebound(handler.batch))
        return
    registry.handler(
        handler.message_type,
        handler.model,
        consumer=handler.consumer,
        inbox=handler.inbox,
        side_effect=handler.runs is Runs.CLAIM,
        key=handler.key,
    )(rebound(handler.func))
