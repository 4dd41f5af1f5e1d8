"""The inbox and the reference handler's accounts table.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_bigint_pk = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    # Each table only when missing: SQLite commits DDL statement by statement, so a
    # killed run may have created the first table and not the second.
    present = set(sa.inspect(op.get_bind()).get_table_names())
    if "inbox" not in present:
        _create_inbox()
    if "accounts" not in present:
        op.create_table(
            "accounts",
            sa.Column("id", sa.String(64), nullable=False),
            sa.Column("balance", sa.Numeric(18, 2), nullable=False),
            sa.Column("version", sa.Integer(), nullable=False),
            sa.PrimaryKeyConstraint("id", name="pk_accounts"),
        )


def _create_inbox() -> None:
    op.create_table(
        "inbox",
        sa.Column("id", _bigint_pk, sa.Identity(), primary_key=True),
        sa.Column("message_id", sa.String(255), nullable=False),
        sa.Column("consumer", sa.String(255), nullable=False),
        sa.Column(
            "received_at",
            sa.DateTime(timezone=True),
            server_default=sa.func.current_timestamp(),
            nullable=False,
        ),
        sa.Column(
            "processed_at", sa.DateTime(timezone=True), server_default=sa.func.current_timestamp()
        ),
        sa.PrimaryKeyConstraint("id", name="pk_inbox"),
        sa.UniqueConstraint("message_id", "consumer", name="uq_inbox_message_consumer"),
    )


def downgrade() -> None:
    op.drop_table("accounts")
    op.drop_table("inbox")
