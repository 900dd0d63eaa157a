"""``ApiKeyStore``: create, revoke and list tenant API keys (verification is in
``tenants.authenticator``).

Only the hash of a key's secret is stored; the plaintext token is returned once, by ``create``.
Audit rows record key ids and the tenant's salt version, never secrets.

Thread-safe: every method opens its own short session.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from tenants.api_keys import generate_api_key
from tenants.errors import ApiKeyNotFound, TenantNotFound
from tenants.models import ApiKey, Tenant, require_aware, utcnow
from tenants.records import ApiKeyInfo, from_row
from tenants.usage import add_audit

__all__ = ["ApiKeyStore", "key_info"]

_KEY_ID_ATTEMPTS = 5  # 48-bit random key ids: a collision is already astronomically rare


def key_info(row: ApiKey) -> ApiKeyInfo:
    """The ``ApiKeyInfo`` of a key row (the one row-to-record copy for keys; no hash)."""
    return from_row(ApiKeyInfo, row)


MAX_KEY_NAME_CHARS = 255  # the column's width


class ApiKeyStore:
    """Tenant API key rows.

    Args:
        session_factory: from ``tenants.db.make_session_factory``.
    """

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self._session_factory = session_factory

    def __repr__(self) -> str:
        return "ApiKeyStore()"

    def create(
        self,
        tenant_id: str,
        name: str | None = None,
        expires_at: datetime | None = None,
        *,
        actor: str = "system",
    ) -> tuple[str, ApiKeyInfo]:
        """Creates an API key for a tenant.

        Args:
            tenant_id: the owning tenant.
            name: optional label.
            expires_at: optional timezone-aware expiry; the key is refused from then on.
            actor: who did it, for the audit log.

        Returns:
            ``(token, info)``. The plaintext token is returned only here and never stored.

        Raises:
            TenantNotFound: if there is no such tenant.
            ValueError: if ``expires_at`` is naive or not in the future (a key dead on arrival),
                or ``name`` is longer than ``MAX_KEY_NAME_CHARS`` or not printable.
        """
        if name is not None and not (isinstance(name, str) and len(name) <= MAX_KEY_NAME_CHARS
                                     and name.isprintable()):
            raise ValueError(f"key name must be at most {MAX_KEY_NAME_CHARS} printable "
                             "characters")
        require_aware(expires_at, "expires_at")
        if expires_at is not None and expires_at <= utcnow():
            raise ValueError("expires_at must be in the future")
        for attempt in range(_KEY_ID_ATTEMPTS):
            new = generate_api_key()
            try:
                with self._session_factory.begin() as session:
                    owner = session.get(Tenant, tenant_id)
                    if owner is None:
                        raise TenantNotFound(f"tenant {tenant_id!r} not found")
                    if session.get(ApiKey, new.key_id) is not None:
                        continue  # key id collision; draw again
                    row = ApiKey(
                        id=new.key_id,
                        tenant_id=tenant_id,
                        key_hash=new.key_hash,
                        display_prefix=new.display_prefix,
                        last4=new.last4,
                        name=name,
                        created_at=utcnow(),
                        expires_at=expires_at,
                    )
                    session.add(row)
                    add_audit(session, actor, "api_key.create", tenant_id,
                              f"key_id={new.key_id} salt_version={owner.current_salt_version}")
                    session.flush()
                    return new.token, key_info(row)
            except IntegrityError:
                if attempt == _KEY_ID_ATTEMPTS - 1:
                    raise
        raise AssertionError("could not draw an unused API key id")

    def revoke(self, key_id: str, *, actor: str = "system") -> ApiKeyInfo:
        """Revokes a key; it is refused from the next request on. Idempotent (a second call
        keeps the first ``revoked_at`` and writes no audit row).

        Raises:
            ApiKeyNotFound: if there is no such key.
        """
        with self._session_factory.begin() as session:
            row = session.get(ApiKey, key_id, with_for_update=True)
            if row is None:
                raise ApiKeyNotFound(f"API key {key_id!r} not found")
            if row.revoked_at is None:
                row.revoked_at = utcnow()
                owner = session.get(Tenant, row.tenant_id)
                version = owner.current_salt_version if owner is not None else None
                add_audit(session, actor, "api_key.revoke", row.tenant_id,
                          f"key_id={key_id} salt_version={version}")
            return key_info(row)

    def list_for_tenant(self, tenant_id: str) -> list[ApiKeyInfo]:
        """Returns a tenant's keys (revoked and expired included), oldest first.

        Raises:
            TenantNotFound: if there is no such tenant.
        """
        with self._session_factory() as session:
            if session.get(Tenant, tenant_id) is None:
                raise TenantNotFound(f"tenant {tenant_id!r} not found")
            rows = session.scalars(
                select(ApiKey)
                .where(ApiKey.tenant_id == tenant_id)
                .order_by(ApiKey.created_at, ApiKey.id)
            )
            return [key_info(r) for r in rows]
