"""Tenant cache epoch: a counter bumped by every cache reset.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01

Replicas share the database but each has its own KV cache. A reset is broadcast to every replica
(``app.cluster``); ``cache_epoch`` is the fallback that needs no message: a replica that meets a
newer epoch on a tenant's next request drops that tenant's cached blocks
(``app.services.cache_generations``), as a newer salt version does after a rotation.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ADD / DROP COLUMN, no batch rebuild: on SQLite a rebuild drops the old table, and
    # with foreign keys on, ON DELETE CASCADE would take every salt, key and usage row with it.
    op.add_column("tenants", sa.Column("cache_epoch", sa.Integer(), server_default="0",
                                       nullable=False))


def downgrade() -> None:
    op.execute("ALTER TABLE tenants DROP COLUMN cache_epoch")  # SQLite >= 3.35: no rebuild
