"""Daily usage rows split cached tokens by tier and count cache writes, as the usage rows do.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07

Plain ``ADD COLUMN``s, then the days already summed are filled from the usage rows they sum
(one grouped pass over them).
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
    day = ("to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')"
           if op.get_bind().dialect.name == "postgresql" else "substr(created_at, 1, 10)")
    # One pass over the usage rows, grouped as usage_daily is (UPDATE ... FROM: PostgreSQL,
    # SQLite >= 3.33). Stop the servers first, as for 0008: writers meanwhile would wait.
    op.execute(
        "UPDATE usage_daily SET tier_cached_tokens = s.tier, cache_write_tokens = s.writes "
        f"FROM (SELECT {day} AS day, tenant_id, COALESCE(key_id, '') AS key_id, model, "
        "SUM(tier_cached_tokens) AS tier, SUM(cache_write_tokens) AS writes "
        f"FROM usage_records GROUP BY {day}, tenant_id, COALESCE(key_id, ''), model) AS s "
        "WHERE usage_daily.day = s.day AND usage_daily.tenant_id = s.tenant_id "
        "AND usage_daily.key_id = s.key_id AND usage_daily.model = s.model")


def downgrade() -> None:
    for column in _COLUMNS:
        op.execute(f"ALTER TABLE usage_daily DROP COLUMN {column}")
