"""The pricing handler's products, with their version token.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02

Created only when missing: a database migrated before the split got it from the
worker's revision 0002.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if sa.inspect(op.get_bind()).has_table("products"):
        return
    op.create_table(
        "products",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("price", sa.Numeric(18, 2), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_products"),
    )


def downgrade() -> None:
    op.drop_table("products")
