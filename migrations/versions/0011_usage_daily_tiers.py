"""Daily usage rows split cached tokens by tier and count cache writes, as the usage rows do.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07

Plain ``ADD COLUMN``s, then the days already summed are filled from the usage rows they sum.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = ("tier_cached_tokens", "cache_write_tokens")


def upgrade() -> None:
    for column in _COLUMNS:
        op.add_column("usage_daily", sa.Column(column, sa.BigInteger(), nullable=False,
                                               server_default="0"))
    day = ("to_char(r.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')"
           if op.get_bind().dialect.name == "postgresql" else "substr(r.created_at, 1, 10)")
    for column in _COLUMNS:
        op.execute(
            f"UPDATE usage_daily SET {column} = (SELECT COALESCE(SUM(r.{column}), 0) "
            "FROM usage_records r WHERE r.tenant_id = usage_daily.tenant_id "
            "AND COALESCE(r.key_id, '') = usage_daily.key_id "
            f"AND r.model = usage_daily.model AND {day} = usage_daily.day)")


def downgrade() -> None:
    for column in _COLUMNS:
        op.execute(f"ALTER TABLE usage_daily DROP COLUMN {column}")
