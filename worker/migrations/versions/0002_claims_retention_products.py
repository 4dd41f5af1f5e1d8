"""Two-phase claims and retention on the inbox; products and rejections tables.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

Every new inbox column is nullable or has a constant server default, so on
PostgreSQL (11+) adding them is a catalog change, not a table rewrite. The
purge index is built CONCURRENTLY on PostgreSQL so a live inbox keeps taking
inserts while it is built.
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


def upgrade() -> None:
    op.add_column(
        "inbox", sa.Column("state", sa.String(16), nullable=False, server_default="finished")
    )
    op.add_column("inbox", sa.Column("lease_until", sa.DateTime(timezone=True)))
    op.add_column("inbox", sa.Column("claimed_by", sa.String(128)))
    op.add_column("inbox", sa.Column("attempts", sa.Integer(), nullable=False, server_default="1"))
    op.add_column("inbox", sa.Column("outcome", sa.String(255)))
    op.add_column("inbox", sa.Column("message_type", sa.String(255)))
    op.add_column("inbox", sa.Column("body", sa.LargeBinary()))
    if op.get_bind().dialect.name == "postgresql":
        with op.get_context().autocommit_block():
            op.create_index(
                "ix_inbox_processed_at", "inbox", ["processed_at"], postgresql_concurrently=True
            )
    else:
        op.create_index("ix_inbox_processed_at", "inbox", ["processed_at"])
    op.create_index(
        "ix_inbox_lease_until",
        "inbox",
        ["lease_until"],
        postgresql_where=_claims_only,
        sqlite_where=_claims_only,
    )
    op.create_table(
        "products",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("price", sa.Numeric(18, 2), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_products"),
    )
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
    op.create_index("ix_rejections_rejected_at", "rejections", ["rejected_at"])


def downgrade() -> None:
    op.drop_index("ix_rejections_rejected_at", table_name="rejections")
    op.drop_table("rejections")
    op.drop_table("products")
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
