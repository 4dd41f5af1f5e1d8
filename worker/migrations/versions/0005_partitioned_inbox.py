"""Inbox admission: the function the worker's skip-duplicate inserts call.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02

A function only: nothing existing is rewritten or locked. On the plain table it is
``SELECT true`` (the unique constraint decides); on a partitioned inbox it takes the
key's lock and looks into every partition. The layout itself is chosen by
``WORKER_INBOX_LAYOUT`` and applied by ``worker migrate`` (worker/partitions.py), at
any time, online; the DDL lives there so that this revision stays easy to move.
"""

from __future__ import annotations

from alembic import op

from worker.partitions import install_admission, remove_admission

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    install_admission(op.get_bind())


def downgrade() -> None:
    remove_admission(op.get_bind())
