"""SQLAlchemy ORM models: tenants, API keys, encrypted tenant salts, usage records, audit log.

The schema changes only through Alembic (``migrations/versions``); keep this file and the
migrations in step. ORM objects never leave ``tenants/``: the repository returns frozen
dataclasses.

All timestamps are timezone-aware UTC ``datetime`` objects in Python (``UTCDateTime``), stored as
``TIMESTAMP WITH TIME ZONE`` on PostgreSQL and as naive UTC ISO strings on SQLite.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    false,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

#: Deterministic constraint names, so migrations can refer to them on every backend.
NAMING_CONVENTION: dict[str, str] = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

#: Allowed values of ``usage_records.status``.
USAGE_STATUSES: tuple[str, ...] = ("ok", "error", "aborted")

# 64-bit ids on PostgreSQL; SQLite only auto-increments a column declared exactly INTEGER.
_BigIntId = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    """Returns the current time as a timezone-aware UTC datetime."""
    return datetime.now(UTC)


def require_aware(value: datetime | None, what: str) -> None:
    """Checks that an optional datetime is timezone-aware.

    Raises:
        ValueError: if ``value`` is naive (its time zone would be a guess).
    """
    if value is not None and (value.tzinfo is None or value.utcoffset() is None):
        raise ValueError(f"{what} must be a timezone-aware datetime (e.g. datetime.now(UTC))")


def new_tenant_id() -> str:
    """Returns a fresh tenant id: 32 lowercase hex chars (``uuid4().hex``)."""
    return uuid.uuid4().hex


class UTCDateTime(TypeDecorator[datetime]):
    """A datetime column that only accepts and only returns timezone-aware UTC datetimes.

    SQLite has no time-zone type, so values are stored there as naive UTC; PostgreSQL stores
    ``timestamptz``. Either way Python code sees ``tzinfo=UTC``.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        """Converts an aware datetime to UTC for storage.

        Raises:
            ValueError: if ``value`` is naive (its time zone would be a guess).
        """
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError("naive datetime given; pass a timezone-aware (UTC) datetime")
        value = value.astimezone(UTC)
        if dialect.name == "sqlite":
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        """Returns the stored value as an aware UTC datetime."""
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    """Declarative base of every saltserve table."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Tenant(Base):
    """A tenant: the trust boundary for prefix-cache sharing."""

    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_tenant_id)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    # ``name.casefold()``: names are unique ignoring case (migration 0003).
    name_key: Mapped[str] = mapped_column(String(255), index=True, unique=True,
                                          server_default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    disabled: Mapped[bool] = mapped_column(Boolean(), default=False, server_default=false())
    current_salt_version: Mapped[int] = mapped_column(Integer())
    enable_prefix_caching: Mapped[bool] = mapped_column(
        Boolean(), default=True, server_default=true()
    )
    # Quotas, enforced later by app/; None = unlimited.
    rpm_limit: Mapped[int | None] = mapped_column(Integer())
    tpm_limit: Mapped[int | None] = mapped_column(Integer())
    max_concurrent: Mapped[int | None] = mapped_column(Integer())
    # Capacity share (engine.request.TenantShare): step budget and cache share by weight.
    weight: Mapped[int] = mapped_column(Integer(), default=1, server_default="1")
    min_cache_blocks: Mapped[int | None] = mapped_column(Integer())
    max_cache_blocks: Mapped[int | None] = mapped_column(Integer())
    # Bumped by every reset of the tenant's prefix cache (migration 0009): replicas that missed
    # the broadcast drop their blocks on the tenant's next request (app.services.cache_generations).
    cache_epoch: Mapped[int] = mapped_column(Integer(), default=0, server_default="0")
    # OpenAI prompt_cache_retention for calls that ask none, and the longest a call may ask
    # ("in_memory" | "24h"; None: "24h"; migration 0010).
    prompt_cache_retention: Mapped[str | None] = mapped_column(String(16))
    max_prompt_cache_retention: Mapped[str | None] = mapped_column(String(16))


class ApiKey(Base):
    """A tenant API key. Only the SHA-256 of the secret part is stored."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(12), primary_key=True)  # key id: 12 lowercase hex
    tenant_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    key_hash: Mapped[str] = mapped_column(String(64))  # hex sha256 of the secret part
    display_prefix: Mapped[str] = mapped_column(String(32))  # "ss-<keyid>"
    last4: Mapped[str] = mapped_column(String(4))
    name: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class TenantSalt(Base):
    """One version of a tenant's secret salt, encrypted with the master key (see ``crypto``)."""

    __tablename__ = "tenant_salts"

    tenant_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    version: Mapped[int] = mapped_column(Integer(), primary_key=True)
    encrypted_salt: Mapped[bytes] = mapped_column(LargeBinary())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    def __repr__(self) -> str:  # never show the ciphertext either
        return f"TenantSalt(tenant_id={self.tenant_id!r}, version={self.version!r})"


class UsageRecordRow(Base):
    """One finished (or failed, or aborted) request's usage."""

    __tablename__ = "usage_records"
    __table_args__ = (
        CheckConstraint("status IN ('ok', 'error', 'aborted')", name="status"),
        Index("ix_usage_records_tenant_id_created_at", "tenant_id", "created_at"),
    )

    id: Mapped[int] = mapped_column(_BigIntId, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(128), index=True)  # journal replays (0006)
    tenant_id: Mapped[str] = mapped_column(String(32), ForeignKey("tenants.id", ondelete="CASCADE"))
    key_id: Mapped[str | None] = mapped_column(String(12))  # None for JWT-authenticated requests
    model: Mapped[str] = mapped_column(String(255))
    endpoint: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    prompt_tokens: Mapped[int] = mapped_column(Integer(), default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer(), default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer(), default=0)
    ttft_s: Mapped[float | None] = mapped_column(Float())
    latency_s: Mapped[float | None] = mapped_column(Float())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
    end_user: Mapped[str | None] = mapped_column(String(256))  # OpenAI user (0007)
    # Of cached_tokens, those loaded from an offload tier; prompt tokens the call added to the
    # cache; OpenAI prompt_cache_key as sent (0010).
    tier_cached_tokens: Mapped[int] = mapped_column(Integer(), default=0, server_default="0")
    cache_write_tokens: Mapped[int] = mapped_column(Integer(), default=0, server_default="0")
    prompt_cache_key: Mapped[str | None] = mapped_column(String(1024))


class AuditLogRow(Base):
    """An operator-visible audit record. ``detail`` never holds a salt or key material."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(_BigIntId, primary_key=True, autoincrement=True)
    time: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(255))
    action: Mapped[str] = mapped_column(String(64))
    tenant_id: Mapped[str | None] = mapped_column(String(32), index=True)  # no FK: outlives tenants
    detail: Mapped[str | None] = mapped_column(Text())
    request_id: Mapped[str | None] = mapped_column(String(128))  # the server's, always
    client_request_id: Mapped[str | None] = mapped_column(String(64))  # X-Request-ID sent


class RevokedToken(Base):
    """A revoked platform JWT, by its ``jti`` (refused on every request from then on)."""

    __tablename__ = "revoked_tokens"

    jti: Mapped[str] = mapped_column(String(64), primary_key=True)
    revoked_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    actor: Mapped[str] = mapped_column(String(255))


# Upper edges (seconds) of the TTFT histogram kept for usage reports; one more bin counts the
# rest. Percentiles are interpolated within a bin, as Prometheus' histogram_quantile does.
TTFT_BINS_S = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TTFT_BIN_COLUMNS = tuple(f"ttft_bin_{i}" for i in range(len(TTFT_BINS_S) + 1))


class UsageDailyRow(Base):
    """Usage summed per UTC day, tenant, key and model (``tenants.usage_reports``): month-long
    daily reports read these rows, not every request's. Kept up to date in the same
    transaction as the usage rows it sums. ``key_id`` is '' for none (part of the primary key).
    End users are not a key here (a tenant chooses them freely, one per request if it likes):
    reports by end user read the raw rows."""

    __tablename__ = "usage_daily"

    day: Mapped[str] = mapped_column(String(10), primary_key=True)  # YYYY-MM-DD, UTC
    tenant_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    key_id: Mapped[str] = mapped_column(String(12), primary_key=True)
    model: Mapped[str] = mapped_column(String(255), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger(), default=0)
    errors: Mapped[int] = mapped_column(BigInteger(), default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger(), default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger(), default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger(), default=0)
    tier_cached_tokens: Mapped[int] = mapped_column(BigInteger(), default=0, server_default="0")
    cache_write_tokens: Mapped[int] = mapped_column(BigInteger(), default=0, server_default="0")
    ttft_bin_0: Mapped[int] = mapped_column(BigInteger(), default=0)
    ttft_bin_1: Mapped[int] = mapped_column(BigInteger(), default=0)
    ttft_bin_2: Mapped[int] = mapped_column(BigInteger(), default=0)
    ttft_bin_3: Mapped[int] = mapped_column(BigInteger(), default=0)
    ttft_bin_4: Mapped[int] = mapped_column(BigInteger(), default=0)
    ttft_bin_5: Mapped[int] = mapped_column(BigInteger(), default=0)
    ttft_bin_6: Mapped[int] = mapped_column(BigInteger(), default=0)
    ttft_bin_7: Mapped[int] = mapped_column(BigInteger(), default=0)
    ttft_bin_8: Mapped[int] = mapped_column(BigInteger(), default=0)
    ttft_bin_9: Mapped[int] = mapped_column(BigInteger(), default=0)
    ttft_bin_10: Mapped[int] = mapped_column(BigInteger(), default=0)

    __table_args__ = (Index("ix_usage_daily_tenant_day", "tenant_id", "day"),)
