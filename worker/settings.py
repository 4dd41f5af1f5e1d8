"""Configuration from ``WORKER_*`` environment variables (pydantic-settings).

Broker adapters keep their own settings class next to their code (for example
``WORKER_RABBITMQ_*`` in :mod:`worker.brokers.rabbitmq`) and load it through
:func:`load`, so every bad value anywhere is reported the same way: one line
naming the variable. Handler modules do the same, under a prefix of their own
that they declare with :func:`handler_settings` (``WORKER_MAIL_*`` in
:mod:`handlers.notify`), so the core's unknown-variable check leaves it to them.
"""

from __future__ import annotations

import difflib
import importlib
import json
import os
import re
import types
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import (
    BeforeValidator,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from worker.errors import ConfigurationError

S = TypeVar("S", bound=BaseSettings)

_SECRET_HINTS = ("url", "password", "connection", "secret", "key")


_WINDOW_INPUTS = ("broker_lock_timeout", "max_deliveries", "message_ttl", "dead_letter_margin")

DURATION_FORMS = (
    "seconds (3600), a number and a unit (90s, 30m, 12h, 14d) or ISO 8601 (PT30M, P14D)"
)
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_NUMBER_AND_UNIT = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd]?)", re.IGNORECASE)
_TIMEDELTA: TypeAdapter[timedelta] = TypeAdapter(timedelta)


def _duration(value: object) -> object:
    """A duration as people write it: seconds, a number and a unit, or ISO 8601.

    pydantic alone reads ``60`` as a malformed ISO duration ("day identifier in duration
    not correctly formatted"), while most users write durations in seconds.
    """
    if not isinstance(value, str) or not value.strip():
        return value
    text = value.strip()
    plain = _NUMBER_AND_UNIT.fullmatch(text)
    if plain is not None:
        return timedelta(seconds=float(plain[1]) * _UNITS[plain[2].lower()])
    try:
        return _TIMEDELTA.validate_python(text)
    except ValidationError:
        raise ValueError(f"takes {DURATION_FORMS}") from None


Duration = Annotated[timedelta, BeforeValidator(_duration)]
"""A ``timedelta`` setting that also takes seconds and units (:data:`DURATION_FORMS`)."""


class Settings(BaseSettings):
    """Everything the pump itself needs. Field ``x`` is the variable ``WORKER_X``."""

    model_config = SettingsConfigDict(env_prefix="WORKER_", extra="ignore")

    database_url: str = Field(
        "sqlite+aiosqlite:///worker.db",
        description="SQLAlchemy async URL; SQLite (aiosqlite, WAL) or PostgreSQL (asyncpg).",
    )
    broker: Literal["memory", "rabbitmq", "kafka", "servicebus"] = "memory"
    handlers: str = Field("handlers", description="Comma-separated modules that register handlers.")
    concurrency: int = Field(16, ge=1, le=1024, description="Deliveries processed at once.")
    max_attempts: int = Field(
        5, ge=1, le=100, description="In-process attempts after a dropped database connection."
    )
    retry_budget: float = Field(
        30.0,
        gt=0,
        description="Seconds a delivery may spend retrying version conflicts, serialization "
        "failures and deadlocks in process before it is given back (uncounted).",
    )
    handler_timeout: float | None = Field(
        300.0, gt=0, description="Seconds one handler attempt may run before it is cancelled."
    )
    marker_lock_timeout: float = Field(
        5.0,
        gt=0,
        description="PostgreSQL: seconds a redelivery's marker waits for the same message "
        "in progress elsewhere before it is given back (uncounted).",
    )
    refuse_unknown_variables: bool = Field(
        False, description="Stop at start on a WORKER_* variable no setting knows."
    )
    max_deliveries: int = Field(5, ge=1, le=1000, description="Deliveries before dead-lettering.")
    delivery_counts: Literal["broker", "database"] = Field(
        "database",
        description="database: a redelivery's start is counted in the database, so a "
        "message that crashes the process is bounded across restarts and the deliveries "
        "it took down spend nothing for being held; broker: the broker's (or the "
        "adapter's in-memory) counts, which count returns.",
    )
    count_first_deliveries: bool = Field(
        False,
        description="With WORKER_DELIVERY_COUNTS=database: count first deliveries' starts "
        "too (one more round trip per message), for brokers that may not flag a redelivery.",
    )
    max_give_backs: int = Field(
        20,
        ge=1,
        le=10_000,
        description="Uncounted give-backs of one message (contention, in progress elsewhere, "
        "a schema behind the code) before further ones count; outages and shutdowns never count.",
    )
    retry_backoff: float = Field(0.02, ge=0, description="Base of the jittered backoff, seconds.")
    retry_backoff_max: float = Field(1.0, ge=0, description="Cap of the jittered backoff, seconds.")
    grace_period: float = Field(25.0, ge=0, description="Seconds in-flight work gets at shutdown.")
    fast_path: bool = Field(True, description="Check the inbox before running a redelivery.")
    # -- group commit (docs/batch.md) --
    batch_size: int = Field(
        32,
        ge=1,
        le=1000,
        description="At most this many deliveries of one type that are ready together share "
        "one transaction (group commit); a delivery alone never waits for company. 1: off.",
    )
    # -- version tokens, side-effect claims, inbox retention (docs/concurrency.md) --
    claim_lease: float = Field(
        60.0,
        gt=0,
        description="Seconds a side-effect claim is held before a replica may take it over.",
    )
    claim_call_timeout: float = Field(
        30.0, gt=0, description="Seconds an external call may take; shorter than the lease."
    )
    broker_lock_timeout: Duration = Field(
        timedelta(minutes=30), description="The broker's lock / visibility / ack timeout."
    )
    message_ttl: Duration = Field(
        timedelta(days=14), description="How long the broker keeps a message it has not delivered."
    )
    dead_letter_margin: Duration = Field(
        timedelta(days=7), description="How late an operator may still re-submit a dead letter."
    )
    inbox_retention: Duration | None = Field(
        None,
        description="Finished markers are kept this long; default and minimum: redelivery window.",
    )
    inbox_layout: Literal["table", "partitioned"] = Field(
        "table",
        description="PostgreSQL: partitioned keeps the inbox in time partitions and retention "
        "drops whole ones (`worker migrate` converts a plain table online); SQLite: table.",
    )
    inbox_partition_period: Duration | None = Field(
        None,
        description="Time one inbox partition covers; default: a quarter of the retention, "
        "in whole days (or hours, minutes, seconds).",
    )
    purge_interval: float = Field(
        600.0, ge=0, description="Seconds between the pump's inbox purge and claim sweep; 0: off."
    )
    purge_batch: int = Field(1000, ge=1, le=50_000, description="Markers deleted per statement.")
    purge_max_batches: int = Field(100, ge=1, description="Statements per purge run.")
    sweep_redrive: bool = Field(
        False, description="The pump's sweep re-runs expired claims itself."
    )

    @field_validator("claim_call_timeout")
    @classmethod
    def _call_inside_lease(cls, value: float, info: ValidationInfo) -> float:
        lease = info.data.get("claim_lease")
        if lease is not None and value >= lease:
            raise ValueError(
                f"must be shorter than WORKER_CLAIM_LEASE ({lease}s): a call that outlives "
                "its lease is taken over and runs twice at once"
            )
        return value

    @field_validator("inbox_retention")
    @classmethod
    def _retention_covers_redelivery(
        cls, value: timedelta | None, info: ValidationInfo
    ) -> timedelta | None:
        if value is None or any(name not in info.data for name in _WINDOW_INPUTS):
            return value
        data = info.data
        window = _window(
            data["broker_lock_timeout"],
            data["max_deliveries"],
            data["message_ttl"],
            data["dead_letter_margin"],
        )
        if value < window:
            raise ValueError(
                f"{value} is shorter than the redelivery window {window} (lock timeout x max "
                "deliveries + message TTL + dead-letter margin): a message redelivered after "
                "its marker was purged would be processed again"
            )
        return value

    @field_validator("inbox_layout")
    @classmethod
    def _partitions_need_postgresql(cls, value: str, info: ValidationInfo) -> str:
        url = info.data.get("database_url")
        if value == "partitioned" and url is not None and url.startswith("sqlite"):
            raise ValueError("needs PostgreSQL: on SQLite the inbox is a plain table")
        return value

    @field_validator("inbox_partition_period")
    @classmethod
    def _few_partitions(cls, value: timedelta | None, info: ValidationInfo) -> timedelta | None:
        if value is None:
            return value
        if value < timedelta(seconds=1) or value % timedelta(seconds=1):
            raise ValueError("must be a whole number of seconds, at least one")
        data = info.data
        retention = data.get("inbox_retention")
        if retention is None and all(name in data for name in _WINDOW_INPUTS):
            retention = _window(
                data["broker_lock_timeout"],
                data["max_deliveries"],
                data["message_ttl"],
                data["dead_letter_margin"],
            )
        if retention is not None and retention / value > MAX_LIVE_PARTITIONS:
            raise ValueError(
                f"the retention {retention} would keep more than {MAX_LIVE_PARTITIONS} "
                "partitions, and every marker insert looks into each: take a longer period"
            )
        return value

    @property
    def redelivery_window(self) -> timedelta:
        """How long after a first delivery the broker (or an operator) may still redeliver."""
        return _window(
            self.broker_lock_timeout, self.max_deliveries, self.message_ttl, self.dead_letter_margin
        )

    @property
    def retention(self) -> timedelta:
        """How long a finished inbox marker is kept: never shorter than the redelivery window."""
        return self.inbox_retention or self.redelivery_window

    @property
    def partition_period(self) -> timedelta:
        """The time one partition of a partitioned inbox covers."""
        return self.inbox_partition_period or default_period(self.retention)

    @property
    def inbox_kept_for(self) -> timedelta:
        """How old a finished marker may get before retention removes it: the retention,
        plus one partition's period when whole partitions are dropped."""
        if self.inbox_layout == "partitioned":
            return self.retention + self.partition_period
        return self.retention

    message_id_func: str | None = Field(
        None, description="'module:function' that extracts the dedup key from a raw message."
    )
    db_pool_size: int | None = Field(None, ge=1, description="Default: concurrency + 2.")
    db_max_overflow: int = Field(
        2,
        ge=0,
        le=1000,
        description="Connections a pod may open beyond the pool for a moment; "
        "(pool + overflow) x pods must fit max_connections (deploy/README.md).",
    )
    allow_sqlite_with_network_broker: bool = Field(
        False,
        description="Let `worker run` use an SQLite URL with RabbitMQ, Kafka or Service Bus "
        "(one host sharing one file; never in Kubernetes, where each pod gets its own).",
    )
    db_probe_backoff_max: float = Field(5.0, gt=0, description="Cap between database probes.")
    start_timeout: float = Field(
        300.0,
        ge=0,
        description="Seconds a start retries a database or broker that is not there yet "
        "(alive, not ready meanwhile); a refused login or a missing database fails at once.",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["auto", "json", "console"] = "auto"
    # -- operations: probes, metrics, tracing (docs/operations.md) --
    ops_port: int | None = Field(
        None, ge=1, le=65535, description="Port of /healthz, /readyz, /metrics; unset: no endpoint."
    )
    ops_host: str = Field("0.0.0.0", description="Address the ops endpoint listens on.")
    ops_stall_timeout: float = Field(
        10.0, gt=0, description="Seconds the event loop may stall before /healthz fails."
    )
    tracing: bool = Field(False, description="OpenTelemetry spans per delivery (the [otel] extra).")

    @field_validator("database_url")
    @classmethod
    def _supported_database(cls, value: str) -> str:
        if not value.startswith(("sqlite+aiosqlite://", "postgresql+asyncpg://")):
            raise ValueError("must start with sqlite+aiosqlite:// or postgresql+asyncpg://")
        if value.startswith("postgresql"):
            _unambiguous(value)
        else:
            _sqlite_folder_exists(value)
        from sqlalchemy.engine import make_url

        try:  # a port that is not a number: a configuration error, not a traceback at connect
            url = make_url(value)
            port = url.port
        except ValueError:
            raise ValueError("the port is not a number between 0 and 65535") from None
        if port is not None and not 0 <= port <= 65535:
            raise ValueError("the port is not a number between 0 and 65535")
        pooler = url.query.get("pooler")  # worker.db.POOLER
        if pooler is not None and (
            pooler not in ("transaction", "session") or value[:6] != "postgr"
        ):
            raise ValueError("pooler= takes transaction or session, on a PostgreSQL URL")
        return value

    @field_validator("message_id_func")
    @classmethod
    def _module_and_function(cls, value: str | None) -> str | None:
        if not value:
            return None
        module, colon, function = value.strip().partition(":")
        dotted = all(part.isidentifier() for part in module.split("."))
        if not colon or not dotted or not function.isidentifier():
            raise ValueError(
                "takes 'module:function' (for example myapp.ids:message_id): the function "
                "that returns the dedup key of the broker's raw message"
            )
        return value.strip()

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @property
    def handler_modules(self) -> list[str]:
        return [name.strip() for name in self.handlers.split(",") if name.strip()]

    @property
    def pool_size(self) -> int:
        return self.db_pool_size or self.concurrency + 2


def _unambiguous(url: str) -> None:
    """Refuse a URL that parsers split in different places (the message never repeats it).

    With a raw ``@`` in the password, SQLAlchemy splits at the first one and takes the
    password's tail for the host name: every connection fails as if the server were away,
    and the tail would travel in host names and error texts.
    """
    if any(character.isspace() for character in url):
        raise ValueError("holds a space: percent-encode it in the user name or password (%20)")
    if url.partition("?")[0].count("@") > 1:
        raise ValueError(
            "holds more than one '@': percent-encode an '@' in the user name or password "
            "as %40 (the text after the first '@' would be taken for the host)"
        )


def _sqlite_folder_exists(url: str) -> None:
    """SQLite creates its file but not the folder: refuse at once what every connect would
    fail on ("unable to open database file"), instead of retrying it as an outage."""
    from sqlalchemy.engine import make_url

    try:
        database = make_url(url).database
    except ValueError:
        return  # the caller reports the URL itself
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    folder = Path(database).parent
    if not folder.is_dir():
        raise ValueError(
            f"the SQLite file's folder {str(folder)!r} does not exist (SQLite creates the "
            "file, not its folder)"
        )


MAX_LIVE_PARTITIONS = 60
"""A partitioned inbox keeps at most this many partitions' worth of retention."""


def _window(lock: timedelta, deliveries: int, ttl: timedelta, margin: timedelta) -> timedelta:
    return lock * deliveries + ttl + margin


def default_period(retention: timedelta) -> timedelta:
    """A quarter of ``retention``, rounded down to whole days (or hours, minutes, seconds):
    about five partitions live, each lookup reads them all."""
    quarter = retention / 4
    for unit in (timedelta(days=1), timedelta(hours=1), timedelta(minutes=1)):
        if quarter >= unit:
            return unit * (quarter // unit)
    return max(timedelta(seconds=1), timedelta(seconds=quarter // timedelta(seconds=1)))


def load(cls: type[S], *, check: bool = True) -> S:
    """Instantiate a settings class from the environment, or raise a one-line error.

    ``check``: also report ``WORKER_*`` variables that no field of ``cls`` knows
    (:func:`check_environment`); ``worker`` calls it itself for the core settings,
    once logging is configured.
    """
    try:
        settings = cls()
    except ValidationError as exc:
        raise ConfigurationError(describe(exc, cls)) from None
    except SettingsError as exc:  # a JSON-typed variable that is not JSON
        raise ConfigurationError(not_json(exc, cls)) from None
    if check:
        check_environment(cls)
    return settings


# Prefixes that belong to other settings classes (adapters, the outbox, the test suite):
# the core Settings leaves their variables to them.
_OWNED_PREFIXES = (
    "WORKER_RABBITMQ_",
    "WORKER_KAFKA_",
    "WORKER_SERVICEBUS_",
    "WORKER_OUTBOX_",
    "WORKER_TEST_",
)

# The settings classes of handler modules, by prefix (see handler_settings).
_HANDLER_SETTINGS: dict[str, type[BaseSettings]] = {}


def _prefix(cls: type[BaseSettings]) -> str:
    return str(cls.model_config.get("env_prefix", "")).upper()


def handler_settings(cls: type[S]) -> type[S]:
    """Declare a handler module's settings class (a class decorator).

    The class reads its variables under a prefix of its own, ``WORKER_<NAME>_``: the
    core's unknown-variable check leaves every variable under it to the class, whose
    :func:`load` reports the typos under it, as the adapters' classes do. A prefix that
    would hide a core variable or another owner's prefix is refused, so a declaration
    can never silence a typo of someone else's.
    """
    prefix = _prefix(cls)
    where = f"{cls.__module__}.{cls.__qualname__}"
    if not prefix.startswith("WORKER_") or not prefix.endswith("_") or prefix == "WORKER_":
        raise ValueError(f"{where}: env_prefix must be WORKER_<NAME>_, not {prefix!r}")
    core = [f"WORKER_{name.upper()}" for name in Settings.model_fields]
    hidden = [name for name in core if name.startswith(prefix)]
    if hidden:
        raise ValueError(f"{where}: env_prefix {prefix!r} would take core variables: {hidden}")
    owners = dict.fromkeys(_OWNED_PREFIXES, "the worker")
    owners.update({p: f"{c.__module__}.{c.__qualname__}" for p, c in _HANDLER_SETTINGS.items()})
    for other, owner in owners.items():
        same = owner == where  # the same class declared again: a re-imported module
        if not same and (other.startswith(prefix) or prefix.startswith(other)):
            raise ValueError(f"{where}: env_prefix {prefix!r} overlaps {other!r} of {owner}")
    _HANDLER_SETTINGS[prefix] = cls
    return cls


def declared_handler_settings() -> list[type[BaseSettings]]:
    """The handler settings classes declared so far (by the handler modules imported)."""
    return list(_HANDLER_SETTINGS.values())


def unknown_variables(
    cls: type[BaseSettings], environ: Mapping[str, str] | None = None
) -> list[str]:
    """``WORKER_*`` names in the environment that no field of ``cls`` reads, with a hint."""
    environ = os.environ if environ is None else environ
    prefix = _prefix(cls)
    known = {prefix + name.upper() for name in cls.model_fields}
    owned = (*_OWNED_PREFIXES, *_HANDLER_SETTINGS)
    others = tuple(p for p in owned if p != prefix and p.startswith(prefix))
    problems = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(prefix) or upper.startswith(others) or upper in known:
            continue
        close = difflib.get_close_matches(upper, known, n=1)
        problems.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return problems


def check_environment(cls: type[BaseSettings]) -> None:
    """Warn about unknown ``WORKER_*`` variables, or refuse them (WORKER_REFUSE_UNKNOWN_VARIABLES).

    A typo such as ``WORKER_CONCURENCY=64`` would otherwise change nothing and say nothing.
    The check of the core settings runs before ``worker run`` imports the handler modules:
    before it calls a variable unknown, it imports them, so their declared settings
    (:func:`handler_settings`) are known.
    """
    unknown = unknown_variables(cls)
    if unknown and cls is Settings:
        _import_handler_modules()
        unknown = unknown_variables(cls)
    if not unknown:
        return
    refuse = os.environ.get("WORKER_REFUSE_UNKNOWN_VARIABLES", "").strip().lower()
    if refuse in ("1", "true", "t", "yes", "y", "on"):  # pydantic's spellings of true
        raise ConfigurationError(
            "unknown variables (WORKER_REFUSE_UNKNOWN_VARIABLES is set): " + ", ".join(unknown)
        )
    from worker.logs import get_logger

    get_logger().warning("unknown WORKER_ variables ignored", variables=unknown)


def _import_handler_modules() -> None:
    """Import the modules of WORKER_HANDLERS, for their declarations; skip what fails.

    A module that cannot be imported declares nothing here; the commands that serve
    handlers report it (``WORKER_HANDLERS: cannot import ...``).
    """
    try:
        modules = Settings().handler_modules
    except ValidationError:
        return
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # reported, in one line, by the command that imports the module
            continue


def describe(exc: ValidationError, cls: type[BaseSettings]) -> str:
    prefix = cls.model_config.get("env_prefix", "")
    problems = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else "?"
        name = f"{prefix}{field}".upper()
        shown = "" if any(h in field for h in _SECRET_HINTS) else f"={error.get('input')!r}"
        form = json_form(cls, field)
        hint = f" ({form})" if form and error["type"] in _TYPE_ERRORS else ""
        problems.append(f"{name}{shown}: {error['msg']}{hint}")
    return "; ".join(problems)


# pydantic's error types for a value of the wrong shape: where a JSON setting says its form
_TYPE_ERRORS = frozenset({"list_type", "dict_type", "string_type", "float_parsing", "float_type"})
_FIELD_NAMED = re.compile(r'field "(?P<field>\w+)"')


def not_json(exc: SettingsError, cls: type[BaseSettings]) -> str:
    """One line for a JSON-typed variable given as plain text: the variable, what it holds,
    the form it takes, and the value written that way where the intent is plain."""
    prefix = str(cls.model_config.get("env_prefix", "")).upper()
    found = _FIELD_NAMED.search(str(exc))
    field = found["field"] if found else ""
    form = json_form(cls, field)
    if not form:
        return f"{prefix}*: {exc}"
    name = f"{prefix}{field.upper()}"
    value = next((v for k, v in os.environ.items() if k.upper() == name), "")
    if any(h in field for h in _SECRET_HINTS if h != "key") or _is_secret(field):
        return f"{name}: not JSON; it takes {form}"
    line = f"{name}={value!r}: not JSON; it takes {form}"
    suggestion = _as_json(cls, field, value)
    return f"{line}; write {name}='{suggestion}'" if suggestion else line


def _is_secret(field: str) -> bool:
    from worker.logs import is_secret_name

    return is_secret_name(field)


def _shape(cls: type[BaseSettings], field: str) -> tuple[type | None, tuple[Any, ...]]:
    """The container type of a JSON-typed field (list or dict, unwrapping ``| None``), and
    its item types; (None, ()) for any other field."""
    info = cls.model_fields.get(field)
    annotation = info.annotation if info is not None else None
    if get_origin(annotation) in (Union, types.UnionType):
        annotation = next((a for a in get_args(annotation) if a is not type(None)), None)
    origin = get_origin(annotation)
    if origin in (list, dict, set, tuple):
        return origin, get_args(annotation)
    return None, ()


def json_form(cls: type[BaseSettings], field: str) -> str:
    """How a JSON-typed field is written, for the messages; "" for any other field."""
    origin, items = _shape(cls, field)
    if origin is None:
        return ""
    if origin is dict:
        what, example = "a JSON object", '{"name": "value"}'
    elif items and items[0] in (float, int):
        what, example = "a JSON list of numbers", "[1, 5, 30]"
    else:
        what, example = "a JSON list of strings", '["first", "second"]'
    described = _JSON_EXAMPLE.search(cls.model_fields[field].description or "")
    if described is not None:  # the field's own example, when its description has one
        try:
            json.loads(described[0])
            example = described[0]
        except ValueError:
            pass
    return f"{what}, such as {example}"


_JSON_EXAMPLE = re.compile(r"\{[^{}]*\}|\[[^\[\]]*\]")


def _as_json(cls: type[BaseSettings], field: str, value: str) -> str:
    """``value`` written as the JSON the field takes, when its meaning is plain: ``a=b,c=d``
    or ``a:b`` for an object, ``x,y`` for a list; "" when it is not."""
    origin, items = _shape(cls, field)
    parts = [part.strip() for part in value.split(",") if part.strip()]
    if not parts:
        return ""
    if origin is dict:
        pairs = [re.split(r"\s*[=:]\s*", part, maxsplit=1) for part in parts]
        if any(len(pair) != 2 or not all(pair) for pair in pairs):
            return ""
        return json.dumps(dict(pairs))
    if items and items[0] in (float, int):
        try:
            return json.dumps([json.loads(part) for part in parts])
        except ValueError:
            return ""
    return json.dumps(parts)
