"""Plain frozen dataclasses that cross the ``tenants`` boundary (never ORM objects).

``AuthContext`` carries a tenant's secret salt, sealed (``tenants.salts.SealedSalt``): it can
derive effective salts but never hand the salt out.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, TypeVar

from tenants.salts import SealedSalt

R = TypeVar("R")


def from_row(record_type: type[R], row: Any, **overrides: Any) -> R:
    """A record (``TenantInfo``, ``ApiKeyInfo``, ``UsageRecord``, ``AuditEntry``) from an ORM
    row or another object with the same attribute names: the one row-to-record copy. Only the
    record's own fields are read (a key row's hash has no field to land in); ``overrides``
    replace values by name."""
    values = {f.name: getattr(row, f.name) for f in fields(record_type)}
    return record_type(**{**values, **overrides})


def row_values(record: Any, **overrides: Any) -> dict[str, Any]:
    """A record's fields by name (with ``overrides``), as ORM row keywords: the one
    record-to-row copy."""
    return {**{f.name: getattr(record, f.name) for f in fields(record)}, **overrides}


@dataclass(frozen=True)
class TenantQuota:
    """A tenant's rate limits and capacity share: the one record that authentication, the rate
    limiter (``app.limits``) and the engine request builder (``engine.request.TenantShare``)
    read. None means unlimited / unbounded.

    Attributes:
        rpm_limit: requests per minute (sliding 60 s window).
        tpm_limit: prompt + completion tokens per minute.
        max_concurrent: requests in flight at once.
        weight: share of each engine step's token budget and of the cached blocks, >= 1
            (weighted fair queuing between tenants).
        min_cache_blocks: cached blocks (KV blocks) never taken from this tenant by another's
            eviction while it holds no more than this many.
        max_cache_blocks: cached blocks above which this tenant's are evicted first.
        prompt_cache_retention: the retention of a call that asks none (OpenAI
            ``prompt_cache_retention``: ``"in_memory"`` or ``"24h"``; None: ``"24h"``).
        max_prompt_cache_retention: the longest a call may ask (None: ``"24h"``);
            ``"in_memory"``: nothing of the tenant's is written to an offload tier.
    """

    rpm_limit: int | None = None
    tpm_limit: int | None = None
    max_concurrent: int | None = None
    weight: int = 1
    min_cache_blocks: int | None = None
    max_cache_blocks: int | None = None
    prompt_cache_retention: str | None = None
    max_prompt_cache_retention: str | None = None

    @property
    def any_limit(self) -> bool:
        """Whether any rate limit (rpm, tpm, concurrency) applies."""
        return (self.rpm_limit is not None or self.tpm_limit is not None
                or self.max_concurrent is not None)


@dataclass(frozen=True)
class TenantInfo:
    """A tenant as seen outside ``tenants/``."""

    id: str
    name: str
    disabled: bool
    current_salt_version: int
    enable_prefix_caching: bool
    created_at: datetime
    # Limits and capacity share, as stored (one column each); the request path reads them as
    # one ``TenantQuota`` (``AuthContext.quota``).
    rpm_limit: int | None = None
    tpm_limit: int | None = None
    max_concurrent: int | None = None
    weight: int = 1
    min_cache_blocks: int | None = None
    max_cache_blocks: int | None = None
    cache_epoch: int = 0  # bumped by every reset of its prefix cache
    prompt_cache_retention: str | None = None  # TenantQuota's
    max_prompt_cache_retention: str | None = None


@dataclass(frozen=True)
class ApiKeyInfo:
    """An API key's public metadata (no secret, no hash)."""

    id: str
    tenant_id: str
    display_prefix: str
    last4: str
    name: str | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    # Last authenticated use, flushed from the authenticator's buffer every minute (None: never).
    last_used_at: datetime | None = None


@dataclass(frozen=True)
class AuthContext:
    """Who a request is from, and the secret it needs to key the prefix cache.

    ``key_id`` is None for JWT-authenticated requests. The tenant salt is held sealed (``_salt``,
    a ``tenants.salts.SealedSalt``): there is no way to read it back, only ``effective_salt``.
    It is left out of ``repr`` and of equality (two contexts of the same tenant, key and salt
    version compare equal). Built only by ``tenants.authenticator``.
    """

    tenant_id: str
    tenant_name: str
    key_id: str | None
    salt_version: int
    enable_prefix_caching: bool
    _salt: SealedSalt = field(repr=False, compare=False)
    quota: TenantQuota = TenantQuota()  # limits (app/limits.py) and share (the engine's)
    cache_epoch: int = 0  # with salt_version: the generation of its cached blocks

    def __repr__(self) -> str:
        return (
            f"AuthContext(tenant_id={self.tenant_id!r}, key_id={self.key_id!r}, "
            f"salt_version={self.salt_version}, salt=<redacted>, "
            f"enable_prefix_caching={self.enable_prefix_caching})"
        )

    def effective_salt(self, client_cache_salt: str | None = None) -> bytes:
        """Returns this request's effective salt, 32 bytes (see ``tenants.salts``).

        Raises:
            ValueError: if ``client_cache_salt`` is empty or longer than 128 chars.
        """
        return self._salt.derive(self.salt_version, client_cache_salt)

    def salt_occurs_in(self, text: str | bytes) -> bool:
        """True if ``text`` contains the tenant salt in a common encoding (leak checks only;
        see ``SealedSalt.occurs_in``)."""
        return self._salt.occurs_in(text)


@dataclass(frozen=True)
class UsageRecord:
    """One request's usage. Times in seconds; ``created_at`` None means "now" when recorded."""

    request_id: str
    tenant_id: str
    key_id: str | None
    model: str
    endpoint: str
    status: str  # "ok" | "error" | "aborted"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    created_at: datetime | None = None
    # OpenAI ``safety_identifier`` / ``user``: the tenant's own end user, for per-user reports.
    end_user: str | None = None
    # Of ``cached_tokens``, tokens loaded from the offload tiers (the rest hit the KV pool).
    tier_cached_tokens: int = 0
    # Prompt tokens the call added to the prefix cache (OpenAI ``cache_write_tokens``).
    cache_write_tokens: int = 0
    # OpenAI ``prompt_cache_key``, as the client sent it.
    prompt_cache_key: str | None = None


@dataclass(frozen=True)
class AuditEntry:
    """One audit-log row."""

    id: int
    time: datetime
    actor: str
    action: str
    tenant_id: str | None
    detail: str | None
    request_id: str | None
    client_request_id: str | None = None
