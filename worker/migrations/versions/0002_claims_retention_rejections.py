"""Two-phase claims and retention on the inbox; the rejections table.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

Every new inbox column is nullable or has a constant server default, so on
PostgreSQL (11+) adding them is a catalog change, not a table rewrite. The
purge index is built CONCURRENTLY on PostgreSQL so a live inbox keeps taking
inserts while it is built. Every step checks what exists first: the revision
can be re-run from wherever a killed run stopped.

Releases before the histories were split also created the example handlers' ``products``
table here; it is the example application's now (handlers/migrations/).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_bigint_pk = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_claims_only = sa.text("lease_until IS NOT NULL")
_PROCESSED_AT_INDEX = "ix_inbox_processed_at"


def _inspector() -> sa.Inspector:
    return sa.inspect(op.get_bind())  # a fresh one: an inspector caches what it read


def _add_missing_columns(table: str, *columns: sa.Column[object]) -> None:
    present = {column["name"] for column in _inspector().get_columns(table)}
    for column in columns:
        if column.name not in present:
            op.add_column(table, column)


def _has_index(table: str, name: str) -> bool:
    return any(index["name"] == name for index in _inspector().get_indexes(table))


def upgrade() -> None:
    # Re-runnable from any point: on PostgreSQL the concurrent index build below has
    # to commit everything before it, so a run killed during the build leaves these
    # columns and tables behind (and the revision still at 0001); the next run skips
    # what exists.
    _add_missing_columns(
        "inbox",
        sa.Column("state", sa.String(16), nullable=False, server_default="finished"),
        sa.Column("lease_until", sa.DateTime(timezone=True)),
        sa.Column("claimed_by", sa.String(128)),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="1"),
        sa.Column("outcome", sa.String(255)),
        sa.Column("message_type", sa.String(255)),
        sa.Column("body", sa.LargeBinary()),
    )
    if not _has_index("inbox", "ix_inbox_lease_until"):
        op.create_index(
            "ix_inbox_lease_until",
            "inbox",
            ["lease_until"],
            postgresql_where=_claims_only,
            sqlite_where=_claims_only,
        )
    if not _inspector().has_table("rejections"):
        op.create_table(
            "rejections",
            sa.Column("id", _bigint_pk, sa.Identity(), nullable=False),
            sa.Column("message_id", sa.String(255), nullable=False),
            sa.Column("consumer", sa.String(255), nullable=False),
            sa.Column("message_type", sa.String(255)),
            sa.Column("reason", sa.String(32), nullable=False),
            sa.Column("subject", sa.String(255)),
            sa.Column("expected_version", sa.BigInteger()),
            sa.Column("actual_version", sa.BigInteger()),
            sa.Column("detail", sa.Text()),
            sa.Column(
                "rejected_at",
                sa.DateTime(timezone=True),
                server_default=sa.func.current_timestamp(),
                nullable=False,
            ),
            sa.PrimaryKeyConstraint("id", name="pk_rejections"),
        )
    if not _has_index("rejections", "ix_rejections_rejected_at"):
        op.create_index("ix_rejections_rejected_at", "rejections", ["rejected_at"])
    if op.get_bind().dialect.name == "postgresql":
        _processed_at_index_concurrently()
    elif not _has_index("inbox", _PROCESSED_AT_INDEX):
        op.create_index(_PROCESSED_AT_INDEX, "inbox", ["processed_at"])


def _processed_at_index_concurrently() -> None:
    """Build the purge index without blocking inserts; last, because it must commit first.

    A build that was interrupted leaves an INVALID index of that name, which
    ``CREATE INDEX ... IF NOT EXISTS`` would happily keep: drop it and build again.
    The build only waits (for older transactions), blocking nobody, so it may wait
    as long as it takes.
    """
    validity = sa.text(
        "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
        "WHERE c.relname = :name AND pg_table_is_visible(c.oid)"
    )
    with op.get_context().autocommit_block():
        bind = op.get_bind()
        valid = bind.execute(validity, {"name": _PROCESSED_AT_INDEX}).scalar()
        if valid:
            return
        configured = bind.execute(sa.text("SHOW lock_timeout")).scalar_one()
        op.execute("SET lock_timeout = 0")
        if valid is False:
            op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {_PROCESSED_AT_INDEX}")
        op.create_index(
            _PROCESSED_AT_INDEX, "inbox", ["processed_at"], postgresql_concurrently=True
        )
        bind.execute(
            sa.text("SELECT set_config('lock_timeout', :value, false)"), {"value": configured}
        )


def downgrade() -> None:
    op.drop_index("ix_rejections_rejected_at", table_name="rejections")
    op.drop_table("rejections")
    op.drop_index("ix_inbox_lease_until", table_name="inbox")
    op.drop_index("ix_inbox_processed_at", table_name="inbox")
    with op.batch_alter_table("inbox") as batch:
        for column in (
            "body",
            "message_type",
            "outcome",
            "attempts",
            "claimed_by",
            "lease_until",
            "state",
        ):
            batch.drop_column(column)
