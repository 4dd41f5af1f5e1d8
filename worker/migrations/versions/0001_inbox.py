"""The inbox.

Revision ID: 0001
Revises:
Create Date: 2026-11-29

Releases before the histories were split also created the example handlers' ``accounts``
table here; it is the example application's now (handlers/migrations/).
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
    # Only when missing: SQLite commits DDL statement by statement, so a run of an older
    # release killed after its first table left the inbox behind, unrecorded.
    if not sa.inspect(op.get_bind()).has_table("inbox"):
        _create_inbox()


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
    op.drop_table("inbox")
