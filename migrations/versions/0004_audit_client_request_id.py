"""Audit rows keep the client's ``X-Request-ID`` apart from the server's request id.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30

``request_id`` is always an id the server generated; the client's header value (a short safe
token, else dropped) goes to ``client_request_id``.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("audit_log") as batch:
        batch.add_column(sa.Column("client_request_id", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("audit_log") as batch:
        batch.drop_column("client_request_id")
