"""Optimistic concurrency beyond the mapper's default: conflict policies, bulk guards, xmin.

The pump already applies *database wins* to every handler: a version-token
conflict (``StaleDataError``) re-runs the whole attempt on a fresh session,
bounded by ``WORKER_MAX_ATTEMPTS`` with jittered backoff. This module adds:

- :func:`save` writes one loaded row guarded by its token and resolves a
  conflict by a :class:`Policy`: ``DATABASE_WINS`` (raise, the pump re-runs),
  ``CLIENT_WINS`` (adopt the current token, write our whole row) or ``MERGE``
  (theirs for fields we did not touch, ours for the ones we changed, and
  :class:`~worker.errors.MergeConflict` only when both changed one field
  differently). It looks before it resolves: a vanished row is
  :class:`~worker.errors.RowDeleted`, never a change to retry.
- :func:`guarded_update` / :func:`guarded_delete`: bulk statements with the
  token in the WHERE and the affected rows compared with the expected ones.
- :class:`XminVersioned`: PostgreSQL's ``xmin`` as a server-side token, and
  :func:`check_version_tokens`, which refuses a server-generated token on
  SQLite at start (it would stay NULL there and guard nothing).

This is the handler author's side. What the pump does with a conflict's
outcome (tell a deleted row from a changed one, record a rejection) is in
:mod:`worker.rejections`.
"""

from __future__ import annotations

import asyncio
import enum
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import (
    ColumnElement,
    FetchedValue,
    Integer,
    Table,
    and_,
    delete,
    event,
    inspect,
    or_,
    select,
    update,
)
from sqlalchemy import cast as cast_
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import (
    DeclarativeBase,
    Mapped,
    Mapper,
    declared_attr,
    mapped_column,
    object_session,
)
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.orm.exc import StaleDataError
from sqlalchemy.types import UserDefinedType

from worker.db import Base
from worker.errors import ConfigurationError, MergeConflict, RowDeleted
from worker.logs import get_logger
from worker.retry import backoff

if TYPE_CHECKING:
    from worker.context import Context

stats: Counter[str] = Counter()
"""Conflicts met and how they ended (for metrics): by :func:`save`, the bulk guards and
:func:`worker.rejections.deleted_row`."""


class Policy(enum.StrEnum):
    """How :func:`save` resolves a version-token conflict."""

    DATABASE_WINS = "database-wins"
    CLIENT_WINS = "client-wins"
    MERGE = "merge"


class RowChanged(StaleDataError):
    """Another writer changed the row first: a ``StaleDataError``, so the pump re-runs it."""


class BulkConflict(RowChanged):
    """A guarded bulk write matched fewer rows than it was given tokens for."""

    def __init__(self, message: str, *, expected: int, affected: int, deleted: list[Any]) -> None:
        super().__init__(message)
        self.expected = expected
        self.affected = affected
        self.deleted = deleted


# -- one row: save() with a policy ----------------------------------------------------


async def save(
    ctx: Context,
    obj: Any,
    *,
    policy: Policy = Policy.DATABASE_WINS,
    attempts: int = 3,
    backoff_base: float = 0.01,
    backoff_max: float = 0.2,
) -> bool:
    """Write the changes made to ``obj`` now, guarded by the token it was loaded with.

    Returns False when nothing changed (no write, so the token does not move:
    a no-op must not invalidate every other reader). The write is a plain
    ``UPDATE ... WHERE pk AND token = :loaded RETURNING token`` run without
    autoflush, so a conflict neither poisons the pump's session nor loses the
    inbox marker already in it. ``attempts`` bounds the client-wins and merge
    rounds (each can lose again to a third writer); when they run out a
    :class:`RowChanged` hands the message back to the pump's database-wins retry.
    """
    session = ctx.session
    row = _Row(obj)
    changed = row.changes()
    if not changed:
        return False
    base = dict(row.originals(changed))  # what we believe the database holds for our fields
    writes = dict(changed)
    token = row.token
    with session.no_autoflush:
        for attempt in range(1, attempts + 1):
            new_token = await row.write(session, writes, token)
            if new_token is not None:
                row.settle({**changed, **writes}, new_token)
                if attempt > 1:
                    _count(ctx, row, f"resolved-{policy.value}", round=attempt)
                return True
            theirs = await row.current(session)  # look before resolving: changed or gone?
            if theirs is None:
                _count(ctx, row, "deleted", round=attempt)
                raise RowDeleted(
                    f"{row.subject} was deleted by another writer",
                    subject=row.subject,
                    expected=_as_int(token),
                )
            _count(ctx, row, "conflict", round=attempt, policy=policy.value)
            if policy is Policy.DATABASE_WINS:
                raise RowChanged(f"{row.subject} was changed by another writer")
            token = theirs[row.version_key]
            if policy is Policy.CLIENT_WINS:
                writes = {k: v for k, v in row.ours().items() if v != theirs[k]}
            else:
                overlap = tuple(
                    k for k, v in changed.items() if theirs[k] != base[k] and theirs[k] != v
                )
                if overlap:
                    _count(ctx, row, "merge-conflict", fields=overlap)
                    raise MergeConflict(
                        f"{row.subject}: both sides changed {', '.join(overlap)}",
                        fields=overlap,
                        subject=row.subject,
                    )
                writes = {k: v for k, v in changed.items() if theirs[k] != v}
                row.adopt({k: v for k, v in theirs.items() if k not in changed})
                base.update({k: theirs[k] for k in changed})
            if not writes:  # the database already holds exactly our values
                row.settle(changed, token)
                _count(ctx, row, f"resolved-{policy.value}", round=attempt)
                return False
            if attempt < attempts:
                await asyncio.sleep(backoff(attempt, backoff_base, backoff_max))
    _count(ctx, row, "attempts-exhausted", policy=policy.value)
    raise RowChanged(f"{row.subject}: still conflicting after {attempts} attempts ({policy.value})")


def _count(ctx: Context, row: _Row, outcome: str, **extra: Any) -> None:
    stats[outcome] += 1
    logger = get_logger(component="concurrency")  # at call time: after logs.configure()
    log = logger.info if outcome.startswith("resolved") else logger.warning
    log(
        "version conflict",
        message_id=ctx.message_id,
        consumer=ctx.consumer,
        attempt=ctx.attempt,
        subject=row.subject,
        outcome=outcome,
        **extra,
    )


class _Row:
    """One loaded, versioned ORM object and the SQL to guard-write it."""

    def __init__(self, obj: Any) -> None:
        state = inspect(obj)
        if state.key is None:
            raise ValueError("save() writes a row loaded from the database; add new rows instead")
        self.obj = obj
        self.state = state
        mapper = state.mapper
        self.table = _single_table(mapper)
        self.version_col = _version_column(mapper)
        self.generator = mapper.version_id_generator
        self.version_key = mapper.get_property_by_column(self.version_col).key
        self.pk_cols = list(mapper.primary_key)
        self.pk = state.identity
        self.subject = f"{self.table.name}:{format_pk(self.pk)}"
        pk_keys = {mapper.get_property_by_column(c).key for c in self.pk_cols}
        self.columns = {
            prop.key: prop.columns[0]
            for prop in mapper.column_attrs
            if prop.columns[0].table is self.table and prop.key not in pk_keys
        }
        history = state.attrs[self.version_key].history
        if history.added:
            raise ValueError(f"{self.subject}: the version token is the database's; do not set it")
        self.token = _loaded(history)
        if self.token is None:
            raise ValueError(f"{self.subject}: its version token is NULL, which guards nothing")

    def changes(self) -> dict[str, Any]:
        """Fields whose value differs from the loaded one (compared by value, not identity)."""
        return {
            key: self.state.attrs[key].history.added[0]
            for key in self.columns
            if key != self.version_key and self.state.attrs[key].history.added
        }

    def originals(self, keys: Iterable[str]) -> dict[str, Any]:
        return {key: _loaded(self.state.attrs[key].history) for key in keys}

    def ours(self) -> dict[str, Any]:
        return {key: self.state.dict[key] for key in self.columns if key != self.version_key}

    def _where(self) -> list[ColumnElement[bool]]:
        return [col == value for col, value in zip(self.pk_cols, self.pk, strict=True)]

    async def write(self, session: AsyncSession, writes: Mapping[str, Any], token: Any) -> Any:
        values = {self.columns[key].key: value for key, value in writes.items()}
        if self.generator:
            values[self.version_col.key] = self.generator(token)
        statement = (
            update(self.table)
            .where(*self._where(), self.version_col == token)
            .values(values)
            .returning(self.version_col)
        )
        return (await session.execute(statement)).scalar()

    async def current(self, session: AsyncSession) -> dict[str, Any] | None:
        keys = list(self.columns)
        statement = select(*(self.columns[key] for key in keys)).where(*self._where())
        found = (await session.execute(statement)).first()
        return None if found is None else dict(zip(keys, found, strict=True))

    def settle(self, written: Mapping[str, Any], token: Any) -> None:
        """Make the written values the object's committed state, so no flush repeats them."""
        for key, value in written.items():
            set_committed_value(self.obj, key, value)
        set_committed_value(self.obj, self.version_key, token)

    def adopt(self, theirs: Mapping[str, Any]) -> None:
        for key, value in theirs.items():
            if key != self.version_key:
                set_committed_value(self.obj, key, value)


def _loaded(history: Any) -> Any:
    values = history.deleted or history.unchanged
    return values[0] if values else None


def _as_int(token: Any) -> int | None:
    return token if isinstance(token, int) else None


def format_pk(pk: Any) -> str:
    return str(pk[0]) if len(pk) == 1 else ",".join(map(str, pk))


def _single_table(mapper: Mapper[Any]) -> Table:
    table = mapper.local_table
    if not isinstance(table, Table) or mapper.inherits is not None:
        raise ConfigurationError(
            f"{mapper.class_.__name__}: guarded writes need a single-table model"
        )
    return table


def _version_column(mapper: Mapper[Any]) -> Any:
    column = mapper.version_id_col
    if column is None:
        raise ConfigurationError(f"{mapper.class_.__name__} has no version token (version_id_col)")
    return column


# -- many rows: guarded bulk writes ------------------------------------------------------


async def guarded_update(
    ctx: Context, model: type[Any], tokens: Mapping[Any, Any], values: Mapping[str, Any]
) -> int:
    """``UPDATE model SET values WHERE (pk, token) IN tokens``, all rows or a :class:`BulkConflict`.

    A bulk UPDATE bypasses the mapper's token check, so a plain one silently
    overwrites whatever changed since the tokens were read. Here ``tokens`` maps
    each primary key (a tuple for a composite key) to the token it was read
    with; fewer affected rows than tokens is a conflict, raised before commit,
    so the pump rolls the whole attempt back and re-runs it (database wins).
    An integer counter is incremented; a server-generated token (xmin) moves
    by itself.
    """
    mapper, table, version_col, keys = _bulk_target(model, tokens)
    assignments = dict(values)
    if mapper.version_id_generator:
        if not isinstance(version_col.type, Integer):
            raise ConfigurationError(f"{table.name}: guarded_update increments integer tokens only")
        assignments[version_col.key] = version_col + 1
    pk_cols = list(mapper.primary_key)
    statement = (
        update(table)
        .where(_at_tokens(pk_cols, version_col, keys))
        .values(assignments)
        .returning(*pk_cols)
    )
    return await _bulk(ctx, table, pk_cols, keys, statement)


async def guarded_delete(ctx: Context, model: type[Any], tokens: Mapping[Any, Any]) -> int:
    """``DELETE`` guarded like :func:`guarded_update`: every row at its token, or a conflict."""
    mapper, table, version_col, keys = _bulk_target(model, tokens)
    pk_cols = list(mapper.primary_key)
    statement = delete(table).where(_at_tokens(pk_cols, version_col, keys)).returning(*pk_cols)
    return await _bulk(ctx, table, pk_cols, keys, statement)


def keys_in(pk_cols: list[Any], keys: list[tuple[Any, ...]]) -> ColumnElement[bool]:
    if len(pk_cols) == 1:
        return cast(ColumnElement[bool], pk_cols[0].in_([key[0] for key in keys]))
    return or_(*(and_(*(c == v for c, v in zip(pk_cols, key, strict=True))) for key in keys))


def _at_tokens(
    pk_cols: list[Any], version_col: Any, keys: list[tuple[tuple[Any, ...], Any]]
) -> ColumnElement[bool]:
    """``(pk = k AND token = t) OR ...``: one typed comparison per value.

    Not a row-value ``IN``: PostgreSQL cannot type its parameters for ``xid``.
    """
    return or_(
        *(
            and_(*(c == v for c, v in zip(pk_cols, key, strict=True)), version_col == token)
            for key, token in keys
        )
    )


def _bulk_target(
    model: type[Any], tokens: Mapping[Any, Any]
) -> tuple[Mapper[Any], Table, Any, list[tuple[tuple[Any, ...], Any]]]:
    mapper = inspect(model)
    table = _single_table(mapper)
    version_col = _version_column(mapper)
    keys = [(key if isinstance(key, tuple) else (key,), token) for key, token in tokens.items()]
    if any(token is None for _, token in keys):
        # ``version = NULL`` matches nothing, and ``version IS NULL`` matches every
        # row whose token was never generated: either way no guard at all.
        raise ValueError(f"{table.name}: a NULL version token guards nothing")
    return mapper, table, version_col, keys


async def _bulk(
    ctx: Context,
    table: Table,
    pk_cols: list[Any],
    keys: list[tuple[tuple[Any, ...], Any]],
    statement: Any,
) -> int:
    if not keys:
        return 0
    session = ctx.session
    with session.no_autoflush:
        affected = {tuple(row) for row in (await session.execute(statement)).all()}
        if len(affected) == len(keys):
            return len(affected)
        missed = [key for key, _ in keys if key not in affected]
        present = await session.execute(select(*pk_cols).where(keys_in(pk_cols, missed)))
    found = {tuple(row) for row in present.all()}
    deleted = [key for key in missed if key not in found]
    stats["bulk-conflict"] += 1
    get_logger(component="concurrency").warning(
        "version conflict",
        message_id=ctx.message_id,
        consumer=ctx.consumer,
        attempt=ctx.attempt,
        subject=table.name,
        outcome="bulk-conflict",
        expected=len(keys),
        affected=len(affected),
        deleted=len(deleted),
    )
    text = (
        f"{table.name}: {len(affected)} of {len(keys)} rows still had their token "
        f"({len(missed) - len(deleted)} changed, {len(deleted)} deleted)"
    )
    if deleted:
        # a row that is gone does not come back on a retry: a rejection, recorded and acked
        subject = f"{table.name}:{format_pk(deleted[0])}"
        raise RowDeleted(text, subject=subject, detail=f"deleted: {len(deleted)} rows")
    raise BulkConflict(text, expected=len(keys), affected=len(affected), deleted=deleted)


# -- server-side tokens -------------------------------------------------------------------


class Xid(UserDefinedType[int]):
    """PostgreSQL's ``xid``. Bound without a cast, so the guard compares ``xid = xid``.

    Mapped as BIGINT, asyncpg sends ``$1::BIGINT`` and PostgreSQL has no
    ``xid = bigint`` operator; as VARCHAR (the usual recipe) it fails the same way.
    """

    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "xid"

    def bind_expression(self, bindvalue: Any) -> Any:
        # an explicit cast: inside a row comparison PostgreSQL cannot infer it
        return cast_(bindvalue, self)


class XminVersioned:
    """Mixin: PostgreSQL's system column ``xmin`` as the row's version token.

    Every committed write gives the row a new ``xmin``, with no column to add
    or maintain. PostgreSQL only: :func:`check_version_tokens` refuses it on SQLite.
    """

    xmin: Mapped[int] = mapped_column(Xid(), system=True, server_default=FetchedValue())

    @declared_attr.directive
    def __mapper_args__(cls) -> dict[str, Any]:
        return {"version_id_col": cls.xmin, "version_id_generator": False}


TRIGGER_MAINTAINED = "version_token_trigger"
"""``info={TRIGGER_MAINTAINED: True}`` marks a server-generated token a trigger really maintains."""


def prepare_models(dialect: str, bases: Iterable[type[DeclarativeBase]] = (Base,)) -> None:
    """At pump start: refuse tokens the database cannot generate; watch versioned writes."""
    check_version_tokens(dialect, bases)
    for base in bases:
        for mapper in base.registry.mappers:
            if mapper.version_id_col is not None and not event.contains(
                mapper, "before_update", _remember_versioned
            ):
                event.listen(mapper, "before_update", _remember_versioned)
                event.listen(mapper, "before_delete", _remember_versioned)


def check_version_tokens(dialect: str, bases: Iterable[type[DeclarativeBase]] = (Base,)) -> None:
    """Refuse, at start, a version token SQLite would never generate.

    A token declared server-generated (``version_id_generator=False``) stays
    NULL on a database that does not generate it; a guard built on it (a hand
    written ``token == loaded`` turns into ``IS NULL``) matches every row. We
    refuse rather than warn: the failure it prevents is silent data loss, and a
    warning at start scrolls away. A trigger-maintained token can say so.
    """
    if dialect != "sqlite":
        return
    for base in bases:
        for mapper in base.registry.mappers:
            column = mapper.version_id_col
            if column is None or mapper.version_id_generator is not False:
                continue
            if getattr(column, "info", {}).get(TRIGGER_MAINTAINED):
                continue
            raise ConfigurationError(
                f"{mapper.class_.__name__}.{column.key}: a server-generated version token "
                "(xmin, version_id_generator=False) is never generated on SQLite; it would stay "
                "NULL and guard nothing. Use an application counter (plain version_id_col)"
            )


# -- changed or deleted: what the pump's database-wins retry needs to tell them apart ---

WRITTEN = "worker.versioned_writes"


def _remember_versioned(_mapper: Mapper[Any], _connection: Any, target: Any) -> None:
    """Keep the versioned rows a flush writes: a failed flush forgets its changes.

    Read by :func:`worker.rejections.deleted_row`. Runs only for UPDATE and DELETE
    of versioned models; other writes pay nothing.
    """
    session = object_session(target)
    if session is not None:
        session.info.setdefault(WRITTEN, []).append(target)
