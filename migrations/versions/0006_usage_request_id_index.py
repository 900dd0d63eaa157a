"""An index on ``usage_records.request_id``: the usage journal looks stored ids up before it
writes a segment (idempotent replays).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_usage_records_request_id", "usage_records", ["request_id"])


def downgrade() -> None:
    op.drop_index("ix_usage_records_request_id", table_name="usage_records")
