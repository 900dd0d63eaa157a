"""Tenant capacity share: weight, min_cache_blocks, max_cache_blocks.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

``weight`` (integer >= 1, default 1) sets the tenant's share of each engine step's token budget
and of the cached KV blocks; ``min_cache_blocks`` / ``max_cache_blocks`` (None = no bound) clamp
its cache share (``engine.request.TenantShare``).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("weight", sa.Integer(), server_default="1", nullable=False))
        batch.add_column(sa.Column("min_cache_blocks", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("max_cache_blocks", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("max_cache_blocks")
        batch.drop_column("min_cache_blocks")
        batch.drop_column("weight")
