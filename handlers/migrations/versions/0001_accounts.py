"""The credit handler's accounts, with their version token.

Revision ID: 0001
Revises:
Create Date: 2026-12-02

The example application's history (WORKER_HANDLERS=handlers), recorded in
``handlers_alembic_version``. A database migrated before the worker's history and the
application's were split already has this table, from the worker's revision 0001: it is
created only when missing, and never dropped by an upgrade.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    if sa.inspect(op.get_bind()).has_table("accounts"):
        return
    op.create_table(
        "accounts",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("balance", sa.Numeric(18, 2), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_accounts"),
    )


def downgrade() -> None:
    op.drop_table("accounts")
