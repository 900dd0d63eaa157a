"""Tenant names are unique ignoring case: a ``name_key`` column (``str.casefold`` of the name).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30

The key is computed in Python (``tenants.tenant_store.name_key``) rather than with SQL
``lower()``, which SQLite applies to ASCII only; a unique constraint on it means two concurrent
creates of "Café" and "CAFÉ" cannot both commit (a unique index), on SQLite and PostgreSQL
alike. A database that
already holds two names equal ignoring case stops the upgrade with a message naming them.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # No table rebuild (a SQLite "batch" rebuild drops the old table, and with foreign keys on,
    # ON DELETE CASCADE would take every salt, key and usage row with it): a plain ADD COLUMN
    # with a default, a backfill, then a unique index.
    op.add_column("tenants", sa.Column("name_key", sa.String(255), nullable=False,
                                       server_default=""))
    conn = op.get_bind()
    seen: dict[str, str] = {}
    for tenant_id, name in conn.execute(sa.text("SELECT id, name FROM tenants")).all():
        key = name.casefold()
        if key in seen:
            raise RuntimeError(f"tenant names {seen[key]!r} and {name!r} differ only in case; "
                               "rename one of them before upgrading")
        if len(key) > 255:
            raise RuntimeError(f"tenant name {name!r} is longer than 255 characters when "
                               "compared ignoring case; rename it before upgrading")
        seen[key] = name
        conn.execute(sa.text("UPDATE tenants SET name_key = :k WHERE id = :i"),
                     {"k": key, "i": tenant_id})
    op.create_index("ix_tenants_name_key", "tenants", ["name_key"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_tenants_name_key", table_name="tenants")
    op.execute("ALTER TABLE tenants DROP COLUMN name_key")  # SQLite >= 3.35: no rebuild
