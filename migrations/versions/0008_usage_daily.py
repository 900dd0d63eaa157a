"""``usage_daily``: usage summed per UTC day, tenant, key and model, for fast daily reports
(``tenants.usage_reports``), filled from the existing usage rows.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30

A new table (no rebuild of another); the backfill is one INSERT ... SELECT ... GROUP BY. Stop
the servers that write to the database while migrating: rows an older server commits after
the backfill's snapshot would be missing from the rollup.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copy of tenants.models.TTFT_BINS_S as of this revision.
TTFT_BINS_S = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _bin_sums() -> str:
    parts = []
    lower = None
    for edge in TTFT_BINS_S:
        cond = f"ttft_s <= {edge}" if lower is None else f"ttft_s > {lower} AND ttft_s <= {edge}"
        parts.append(f"SUM(CASE WHEN {cond} THEN 1 ELSE 0 END)")
        lower = edge
    parts.append(f"SUM(CASE WHEN ttft_s > {lower} THEN 1 ELSE 0 END)")
    return ", ".join(parts)


def backfill_sql(dialect: str) -> str:
    """The INSERT that sums ``usage_records`` into ``usage_daily`` (also used by the report
    benchmark to build the table after a bulk load)."""
    day = ("to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')" if dialect == "postgresql"
           else "substr(created_at, 1, 10)")
    bins = ", ".join(f"ttft_bin_{i}" for i in range(len(TTFT_BINS_S) + 1))
    return (
        "INSERT INTO usage_daily (day, tenant_id, key_id, model, requests, errors, "
        f"prompt_tokens, cached_tokens, completion_tokens, {bins}) "
        f"SELECT {day}, tenant_id, COALESCE(key_id, ''), model, "
        "COUNT(*), SUM(CASE WHEN status <> 'ok' THEN 1 ELSE 0 END), SUM(prompt_tokens), "
        f"SUM(cached_tokens), SUM(completion_tokens), {_bin_sums()} "
        f"FROM usage_records GROUP BY {day}, tenant_id, COALESCE(key_id, ''), model")


def upgrade() -> None:
    counters = [sa.Column(name, sa.BigInteger(), nullable=False) for name in (
        "requests", "errors", "prompt_tokens", "cached_tokens", "completion_tokens",
        *[f"ttft_bin_{i}" for i in range(len(TTFT_BINS_S) + 1)])]
    op.create_table(
        "usage_daily",
        sa.Column("day", sa.String(10), primary_key=True),
        sa.Column("tenant_id", sa.String(32), sa.ForeignKey("tenants.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("key_id", sa.String(12), primary_key=True),
        sa.Column("model", sa.String(255), primary_key=True),
        *counters)
    op.create_index("ix_usage_daily_tenant_day", "usage_daily", ["tenant_id", "day"])
    op.execute(backfill_sql(op.get_bind().dialect.name))


def downgrade() -> None:
    op.drop_index("ix_usage_daily_tenant_day", table_name="usage_daily")
    op.drop_table("usage_daily")
