"""Kafka offsets stored in the database, and delivery counts that survive restarts.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

Two new tables only: nothing existing is rewritten or locked.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "consumer_offsets",
        sa.Column("group_id", sa.String(255), nullable=False),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("next_offset", sa.BigInteger()),
        sa.Column("epoch", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("started_through", sa.BigInteger()),
        sa.Column("owner", sa.String(255)),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.func.current_timestamp(),
        ),
        sa.PrimaryKeyConstraint("group_id", "topic", "partition", name="pk_consumer_offsets"),
    )
    op.create_table(
        "delivery_counts",
        sa.Column("message_id", sa.String(255), nullable=False),
        sa.Column("consumer", sa.String(255), nullable=False),
        sa.Column("deliveries", sa.Integer(), nullable=False),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.func.current_timestamp(),
        ),
        sa.PrimaryKeyConstraint("message_id", "consumer", name="pk_delivery_counts"),
    )
    op.create_index("ix_delivery_counts_updated_at", "delivery_counts", ["updated_at"])


def downgrade() -> None:
    op.drop_index("ix_delivery_counts_updated_at", table_name="delivery_counts")
    op.drop_table("delivery_counts")
    op.drop_table("consumer_offsets")
