"""Usage rows split cached tokens by tier and name the prompt cache key; tenants get a
prompt-cache retention default and maximum (OpenAI ``prompt_cache_retention``).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07

Plain ``ADD COLUMN``s (no table rebuild on SQLite).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("usage_records", sa.Column("tier_cached_tokens", sa.Integer(), nullable=False,
                                             server_default="0"))
    op.add_column("usage_records", sa.Column("cache_write_tokens", sa.Integer(), nullable=False,
                                             server_default="0"))
    op.add_column("usage_records", sa.Column("prompt_cache_key", sa.String(1024),
                                             nullable=True))
    op.add_column("tenants", sa.Column("prompt_cache_retention", sa.String(16), nullable=True))
    op.add_column("tenants", sa.Column("max_prompt_cache_retention", sa.String(16),
                                       nullable=True))


def downgrade() -> None:
    # Plain DROP COLUMN, no batch rebuild: on SQLite a rebuild of ``tenants`` drops the old
    # table, and with foreign keys on, ON DELETE CASCADE would take every salt, key and usage
    # row with it (SQLite >= 3.35 drops a column in place).
    for column in ("prompt_cache_key", "cache_write_tokens", "tier_cached_tokens"):
        op.execute(f"ALTER TABLE usage_records DROP COLUMN {column}")
    for column in ("max_prompt_cache_retention", "prompt_cache_retention"):
        op.execute(f"ALTER TABLE tenants DROP COLUMN {column}")
