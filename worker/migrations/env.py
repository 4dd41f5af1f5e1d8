"""The Alembic environment every history runs in: the worker's and each application's.

:mod:`worker.migrate` opens the one connection (on PostgreSQL with the migration's
advisory lock and lock timeout set) and hands it over with the history to run. Each
revision commits on its own (``transaction_per_migration``): a run killed in revision N
keeps N-1 and repeats N, which every revision is written to allow.

Autogenerate compares only the tables the history owns
(:meth:`worker.histories.History.tables`), in the models and in the database alike: the
worker's autogenerate never proposes to drop an application's tables, an application's
never proposes to drop the worker's (or another application's), and a table that is
nobody's model (one the application dropped from its code) is never dropped unasked.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from worker.db import Base
from worker.histories import History

config = context.config
history: History = config.attributes["history"]
connection: Connection = config.attributes["connection"]
if history.is_workers and config.attributes.get("autogenerate"):
    # the worker's models, for its maintainers' autogenerate (the Kafka one loads aiokafka)
    import worker.attempts
    import worker.brokers.kafka.offsets
    import worker.inbox
    import worker.outbox.model
    import worker.rejections  # noqa: F401
owned = history.tables()


def include_name(name: str | None, type_: str, parent_names: object) -> bool:
    return type_ != "table" or name in owned


def include_object(
    item: object, name: str | None, type_: str, reflected: bool, compare_to: object
) -> bool:
    return type_ != "table" or name in owned


context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    version_table=history.version_table,
    include_name=include_name,
    include_object=include_object,
    render_as_batch=True,
    transaction_per_migration=True,
)
with context.begin_transaction():
    context.run_migrations()
