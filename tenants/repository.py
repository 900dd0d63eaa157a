"""``TenantRepository``: one facade over the ``tenants`` stores, for the CLI, bootstrap and tests.

It composes one object per concern, sharing one session factory and cipher:

- ``tenants``: ``TenantStore`` (tenant rows, salt rows: create, rotate, re-encrypt);
- ``keys``: ``ApiKeyStore`` (create, revoke, list API keys);
- ``authenticator``: ``Authenticator`` (API key or JWT tenant -> ``AuthContext``; salt cache;
  buffered ``last_used_at``);
- ``usage``: ``UsageStore`` (usage records and the audit log);
- ``revocations``: ``TokenRevocations`` (platform JWTs revoked by ``jti``).

New code should use those attributes; the methods below delegate to them and keep their old
names. Everything returns plain frozen dataclasses (``tenants.records``, re-exported here),
never ORM objects. Salts leave ``tenants`` only sealed inside ``AuthContext``; logs and audit
rows record salt versions only. Thread-safe (see each part).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session, sessionmaker

from tenants.api_key_store import ApiKeyStore
from tenants.authenticator import Authenticator
from tenants.crypto import SaltCipher
from tenants.records import ApiKeyInfo, AuditEntry, AuthContext, TenantInfo, UsageRecord
from tenants.revocations import TokenRevocations
from tenants.tenant_store import MAX_TENANT_NAME_CHARS, UNCHANGED, TenantStore, _Unchanged
from tenants.usage import UsageStore

__all__ = [
    "MAX_TENANT_NAME_CHARS",
    "UNCHANGED",
    "ApiKeyInfo",
    "AuditEntry",
    "AuthContext",
    "TenantInfo",
    "TenantRepository",
    "UsageRecord",
]


class TenantRepository:
    """Tenants, API keys, salts, authentication, usage and audit records over one database.

    Args:
        session_factory: from ``tenants.db.make_session_factory``.
        cipher: encrypts/decrypts salts at rest.

    Attributes:
        tenants: the ``TenantStore``.
        keys: the ``ApiKeyStore``.
        authenticator: the ``Authenticator`` (told about new salts by ``tenants``).
        usage: the ``UsageStore``.
        revocations: the ``TokenRevocations``.
    """

    def __init__(self, session_factory: sessionmaker[Session], cipher: SaltCipher) -> None:
        self.authenticator = Authenticator(session_factory, cipher)
        self.tenants = TenantStore(session_factory, cipher, observer=self.authenticator)
        self.keys = ApiKeyStore(session_factory)
        self.usage = UsageStore(session_factory)
        self.revocations = TokenRevocations(session_factory)

    def __repr__(self) -> str:
        return "TenantRepository(<redacted>)"

    # ------------------------------------------------------------------ tenants (TenantStore)

    def create_tenant(
        self, name: str, *, enable_prefix_caching: bool = True, actor: str = "system"
    ) -> TenantInfo:
        """See ``TenantStore.create``.

        Raises:
            ValueError: if ``name`` is empty or too long.
            DuplicateTenant: if a tenant with this name exists.
        """
        return self.tenants.create(name, enable_prefix_caching=enable_prefix_caching,
                                   actor=actor)

    def get_tenant(self, tenant_id: str) -> TenantInfo:
        """See ``TenantStore.get``.

        Raises:
            TenantNotFound: if there is no such tenant.
        """
        return self.tenants.get(tenant_id)

    def get_tenant_by_name(self, name: str) -> TenantInfo:
        """See ``TenantStore.get_by_name``.

        Raises:
            TenantNotFound: if there is no such tenant.
        """
        return self.tenants.get_by_name(name)

    def list_tenants(self) -> list[TenantInfo]:
        """See ``TenantStore.list_all``: all tenants, oldest first."""
        return self.tenants.list_all()

    def update_tenant(
        self,
        tenant_id: str,
        *,
        disabled: bool | None = None,
        enable_prefix_caching: bool | None = None,
        rpm_limit: int | None | _Unchanged = UNCHANGED,
        tpm_limit: int | None | _Unchanged = UNCHANGED,
        max_concurrent: int | None | _Unchanged = UNCHANGED,
        weight: int | None = None,
        min_cache_blocks: int | None | _Unchanged = UNCHANGED,
        max_cache_blocks: int | None | _Unchanged = UNCHANGED,
        actor: str = "system",
    ) -> TenantInfo:
        """See ``TenantStore.update``.

        Raises:
            TenantNotFound: if there is no such tenant.
            ValueError: a bad limit, weight or cache bound.
        """
        return self.tenants.update(
            tenant_id, disabled=disabled, enable_prefix_caching=enable_prefix_caching,
            rpm_limit=rpm_limit, tpm_limit=tpm_limit, max_concurrent=max_concurrent,
            weight=weight, min_cache_blocks=min_cache_blocks, max_cache_blocks=max_cache_blocks,
            actor=actor)

    def rotate_salt(self, tenant_id: str, *, actor: str = "system") -> int:
        """See ``TenantStore.rotate_salt``; returns the new current salt version.

        Raises:
            TenantNotFound: if there is no such tenant.
        """
        return self.tenants.rotate_salt(tenant_id, actor=actor)

    def reencrypt_salts(self, new_cipher: SaltCipher, *, actor: str = "system") -> int:
        """See ``TenantStore.reencrypt_salts``; returns the number of salt rows re-encrypted.

        Raises:
            SaltDecryptionError: if a stored salt does not decrypt with the current key.
        """
        return self.tenants.reencrypt_salts(new_cipher, actor=actor)

    # ------------------------------------------------------------------ API keys (ApiKeyStore)

    def create_api_key(
        self,
        tenant_id: str,
        name: str | None = None,
        expires_at: datetime | None = None,
        *,
        actor: str = "system",
    ) -> tuple[str, ApiKeyInfo]:
        """See ``ApiKeyStore.create``: ``(token, info)``, the token shown only here.

        Raises:
            TenantNotFound: if there is no such tenant.
            ValueError: if ``expires_at`` is naive.
        """
        return self.keys.create(tenant_id, name, expires_at, actor=actor)

    def revoke_api_key(self, key_id: str, *, actor: str = "system") -> ApiKeyInfo:
        """See ``ApiKeyStore.revoke``.

        Raises:
            ApiKeyNotFound: if there is no such key.
        """
        return self.keys.revoke(key_id, actor=actor)

    def list_api_keys(self, tenant_id: str) -> list[ApiKeyInfo]:
        """See ``ApiKeyStore.list_for_tenant``.

        Raises:
            TenantNotFound: if there is no such tenant.
        """
        return self.keys.list_for_tenant(tenant_id)

    # ------------------------------------------------------------------ auth (Authenticator)

    def get_auth_context(self, tenant_id: str) -> AuthContext:
        """See ``Authenticator.context_for_tenant``.

        Raises:
            TenantNotFound: if there is no such tenant.
            TenantDisabled: if the tenant is disabled.
        """
        return self.authenticator.context_for_tenant(tenant_id)

    def authenticate_api_key(self, token: str, now: datetime | None = None) -> AuthContext:
        """See ``Authenticator.authenticate_api_key``.

        Raises:
            InvalidToken: malformed, unknown, wrong, revoked or expired key.
            TenantDisabled: if the key's tenant is disabled.
            ValueError: if ``now`` is naive.
            SaltDecryptionError: if the stored salt does not decrypt (wrong master key).
        """
        return self.authenticator.authenticate_api_key(token, now)

    def flush_last_used(self) -> int:
        """See ``Authenticator.flush_last_used``; returns the number of keys written.

        Raises:
            sqlalchemy.exc.SQLAlchemyError: if the write fails (the times stay buffered).
        """
        return self.authenticator.flush_last_used()

    # ------------------------------------------------------------------ usage, audit (UsageStore)

    def record_usage(self, record: UsageRecord) -> None:
        """See ``UsageStore.record_usage``.

        Raises:
            ValueError: bad status, negative token count, or naive ``created_at``.
            sqlalchemy.exc.IntegrityError: if ``tenant_id`` does not exist.
        """
        self.usage.record_usage(record)

    def list_usage(
        self,
        tenant_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int | None = None,
    ) -> list[UsageRecord]:
        """See ``UsageStore.list_usage``.

        Raises:
            ValueError: if ``since`` or ``until`` is naive.
        """
        return self.usage.list_usage(tenant_id, since, until, limit)

    def audit(
        self,
        actor: str,
        action: str,
        tenant_id: str | None = None,
        detail: str | None = None,
        request_id: str | None = None,
    ) -> None:
        """See ``UsageStore.audit``. Never pass a salt, key secret or key hash in ``detail``."""
        self.usage.audit(actor, action, tenant_id, detail, request_id)

    def list_audit(self, tenant_id: str | None = None, limit: int = 100) -> list[AuditEntry]:
        """See ``UsageStore.list_audit``: newest first, at most ``limit``."""
        return self.usage.list_audit(tenant_id, limit)
