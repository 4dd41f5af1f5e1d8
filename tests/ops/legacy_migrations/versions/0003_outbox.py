"""The transactional outbox: events handlers published, until the relay has sent them.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

A new table only: nothing existing is rewritten or locked.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_bigint_pk = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "outbox",
        sa.Column("id", _bigint_pk, sa.Identity(), nullable=False),
        sa.Column("message_id", sa.String(64), nullable=False),
        sa.Column("message_type", sa.String(255), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("headers", sa.Text(), nullable=False, server_default="{}"),
        sa.Column("key", sa.String(255)),
        sa.Column("destination", sa.String(512)),
        sa.Column("source_message_id", sa.String(255), nullable=False),
        sa.Column("consumer", sa.String(255), nullable=False),
        sa.Column("state", sa.String(16), nullable=False, server_default="pending"),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.func.current_timestamp(),
        ),
        sa.Column(
            "available_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.func.current_timestamp(),
        ),
        sa.Column("lease_until", sa.DateTime(timezone=True)),
        sa.Column("claimed_by", sa.String(128)),
        sa.Column("sent_at", sa.DateTime(timezone=True)),
        sa.Column("last_error", sa.Text()),
        sa.PrimaryKeyConstraint("id", name="pk_outbox"),
        sa.UniqueConstraint("message_id", name="uq_outbox_message_id"),
    )
    op.create_index("ix_outbox_state_id", "outbox", ["state", "id"])
    op.create_index("ix_outbox_key_id", "outbox", ["key", "id"])
    op.create_index("ix_outbox_sent_at", "outbox", ["sent_at"])


def downgrade() -> None:
    op.drop_index("ix_outbox_sent_at", table_name="outbox")
    op.drop_index("ix_outbox_key_id", table_name="outbox")
    op.drop_index("ix_outbox_state_id", table_name="outbox")
    op.drop_table("outbox")
