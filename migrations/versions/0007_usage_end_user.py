"""Usage rows name the tenant's end user (OpenAI ``safety_identifier`` / ``user``).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30

A plain ``ADD COLUMN`` (no table rebuild on SQLite).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("usage_records", sa.Column("end_user", sa.String(256), nullable=True))


def downgrade() -> None:
    # Nothing references usage_records, so SQLite's batch rebuild cascades nowhere.
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("end_user")
