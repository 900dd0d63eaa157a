"""Tenant names are unique ignoring case: a ``name_key`` column (``str.casefold`` of the name).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30

The key is computed in Python (``tenants.tenant_store.name_key``) rather than with SQL
``lower()``, which SQLite applies to ASCII only; a unique constraint on it means two concurrent
creates of "Café" and "CAFÉ" cannot both commit, on SQLite and PostgreSQL alike. A database that
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
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("name_key", sa.String(255), nullable=True))
    conn = op.get_bind()
    seen: dict[str, str] = {}
    for tenant_id, name in conn.execute(sa.text("SELECT id, name FROM tenants")).all():
        key = name.casefold()
        if key in seen:
            raise RuntimeError(f"tenant names {seen[key]!r} and {name!r} differ only in case; "
                               "rename one of them before upgrading")
        seen[key] = name
        conn.execute(sa.text("UPDATE tenants SET name_key = :k WHERE id = :i"),
                     {"k": key, "i": tenant_id})
    with op.batch_alter_table("tenants") as batch:
        batch.alter_column("name_key", existing_type=sa.String(255), nullable=False)
        batch.create_unique_constraint("uq_tenants_name_key", ["name_key"])


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_constraint("uq_tenants_name_key", type_="unique")
        batch.drop_column("name_key")
