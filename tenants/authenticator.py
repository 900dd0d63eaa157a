"""``Authenticator``: bearer credentials -> ``AuthContext`` (the request hot path).

Two ways in: a tenant API key (``authenticate_api_key``), or a tenant id taken from verified JWT
claims (``context_for_tenant``; ``tenants.tokens.JWTVerifier`` verifies the token itself). Both
return an ``AuthContext`` with the tenant's current salt sealed inside it.

Owns two pieces of in-memory state, each behind its own lock (thread-safe):

- the decrypted-salt cache: at most one salt per tenant, its current version as far as this
  process knows. A newer version (a rotation here, reported by ``TenantStore`` through
  ``salt_created``, or one met in the database after a rotation elsewhere) replaces the older
  one, so a rotated-away salt does not linger in memory;
- the ``last_used_at`` buffer: key uses are noted in memory and written by ``flush_last_used``
  (no database write per request).

Never logs; salts leave only sealed (``tenants.salts.SealedSalt``).
"""

from __future__ import annotations

import threading
from datetime import datetime

from sqlalchemy import and_, bindparam, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from tenants.api_keys import parse_api_key, verify_secret
from tenants.crypto import SaltCipher
from tenants.errors import InvalidToken, TenantDisabled, TenantNotFound
from tenants.models import ApiKey, Tenant, TenantSalt, require_aware, utcnow
from tenants.records import AuthContext, TenantQuota, from_row
from tenants.salts import SealedSalt

__all__ = ["Authenticator"]


def _auth_context(tenant: Tenant, key_id: str | None, salt: SealedSalt) -> AuthContext:
    """The one ``AuthContext`` construction: ``tenant``'s current version and limits."""
    return AuthContext(
        tenant_id=tenant.id,
        tenant_name=tenant.name,
        key_id=key_id,
        salt_version=tenant.current_salt_version,
        enable_prefix_caching=tenant.enable_prefix_caching,
        _salt=salt,
        quota=from_row(TenantQuota, tenant),
        cache_epoch=tenant.cache_epoch,
    )


class Authenticator:
    """Resolves credentials to an ``AuthContext``; caches salts; buffers key use.

    Args:
        session_factory: from ``tenants.db.make_session_factory``.
        cipher: decrypts salts at rest (replaced by ``cipher_replaced``).
    """

    def __init__(self, session_factory: sessionmaker[Session], cipher: SaltCipher) -> None:
        self._session_factory = session_factory
        self._cipher = cipher
        self._salt_lock = threading.Lock()
        self._salts: dict[str, tuple[int, SealedSalt]] = {}  # tenant id -> (version, salt)
        self._used_lock = threading.Lock()
        self._last_used: dict[str, datetime] = {}  # key id -> latest use, not yet flushed

    def __repr__(self) -> str:
        return "Authenticator(<redacted>)"

    # ------------------------------------------------------------------ salt cache

    def salt_created(self, tenant_id: str, version: int, salt: SealedSalt) -> None:
        """Caches a tenant's new current salt, dropping any older one (``SaltObserver``)."""
        self._remember(tenant_id, version, salt)

    def cipher_replaced(self, cipher: SaltCipher) -> None:
        """Decrypts with ``cipher`` from now on (``SaltObserver``; master-key rotation). Cached
        salts stay valid: re-encryption does not change them."""
        self._cipher = cipher

    def cached_salt_version(self, tenant_id: str) -> int | None:
        """The salt version cached for ``tenant_id``, or None (diagnostics and tests)."""
        with self._salt_lock:
            entry = self._salts.get(tenant_id)
        return None if entry is None else entry[0]

    def _remember(self, tenant_id: str, version: int, salt: SealedSalt) -> None:
        with self._salt_lock:
            entry = self._salts.get(tenant_id)
            if entry is None or entry[0] <= version:  # never step back to an older version
                self._salts[tenant_id] = (version, salt)

    def _salt(self, session: Session, tenant_id: str, version: int) -> SealedSalt:
        with self._salt_lock:
            entry = self._salts.get(tenant_id)
        if entry is not None and entry[0] == version:
            return entry[1]
        blob = session.scalar(
            select(TenantSalt.encrypted_salt).where(
                TenantSalt.tenant_id == tenant_id, TenantSalt.version == version
            )
        )
        assert blob is not None, f"tenant {tenant_id} has no salt row for version {version}"
        salt = SealedSalt(self._cipher.decrypt(tenant_id, version, blob))
        self._remember(tenant_id, version, salt)
        return salt

    # ------------------------------------------------------------------ authentication

    def context_for_tenant(self, tenant_id: str) -> AuthContext:
        """The ``AuthContext`` of a tenant authenticated another way (verified JWT claims);
        ``key_id`` is None.

        Raises:
            TenantNotFound: if there is no such tenant.
            TenantDisabled: if the tenant is disabled.
            SaltDecryptionError: if the stored salt does not decrypt (wrong master key).
        """
        with self._session_factory() as session:
            tenant = session.get(Tenant, tenant_id)
            if tenant is None:
                raise TenantNotFound(f"tenant {tenant_id!r} not found")
            if tenant.disabled:
                raise TenantDisabled(f"tenant {tenant_id!r} is disabled")
            return _auth_context(
                tenant, None, self._salt(session, tenant.id, tenant.current_salt_version))

    def authenticate_api_key(self, token: str, now: datetime | None = None) -> AuthContext:
        """Verifies an API key and returns the caller's tenant and current salt.

        The hot path: one indexed query (plus one more on a salt-cache miss); the secret is
        compared in constant time, and an unknown key id still costs one comparison. Use is
        buffered in memory (``flush_last_used`` writes it).

        Args:
            token: the bearer token, ``ss-<key id>-<secret>``.
            now: the time to check expiry against (timezone-aware); defaults to now.

        Returns:
            The authenticated context.

        Raises:
            InvalidToken: malformed, unknown key id, wrong secret, revoked or expired
                (``reason`` says which; the message does not).
            TenantDisabled: if the key is valid but its tenant is disabled.
            ValueError: if ``now`` is naive.
            SaltDecryptionError: if the stored salt does not decrypt (wrong master key).
        """
        require_aware(now, "now")
        now = utcnow() if now is None else now
        parsed = parse_api_key(token)
        if parsed is None:
            raise InvalidToken("malformed")
        with self._session_factory() as session:
            found = session.execute(
                select(ApiKey, Tenant)
                .join(Tenant, ApiKey.tenant_id == Tenant.id)
                .where(ApiKey.id == parsed.key_id)
            ).one_or_none()
            key, tenant = (None, None) if found is None else found
            # Always one constant-time comparison, whether or not the key id exists.
            if not verify_secret(parsed.secret, None if key is None else key.key_hash):
                raise InvalidToken("unknown_key" if key is None else "bad_secret")
            assert key is not None and tenant is not None
            # Checked only after the secret, so revocation/expiry cannot be probed without it.
            if key.revoked_at is not None:
                raise InvalidToken("revoked")
            if key.expires_at is not None and key.expires_at <= now:
                raise InvalidToken("expired")
            if tenant.disabled:
                raise TenantDisabled(f"tenant {tenant.id!r} is disabled")
            key_id = key.id
            ctx = _auth_context(
                tenant, key_id, self._salt(session, tenant.id, tenant.current_salt_version))
        with self._used_lock:
            previous = self._last_used.get(key_id)
            if previous is None or previous < now:
                self._last_used[key_id] = now
        return ctx

    # ------------------------------------------------------------------ last_used_at

    def flush_last_used(self) -> int:
        """Writes buffered ``last_used_at`` times in one transaction (call periodically and at
        shutdown). A stored time is never moved backwards. On failure the buffer is kept.

        Returns:
            The number of keys written.

        Raises:
            sqlalchemy.exc.SQLAlchemyError: if the write fails (the times stay buffered).
        """
        with self._used_lock:
            pending, self._last_used = self._last_used, {}
        if not pending:
            return 0
        # A Core UPDATE on the connection: one executemany, no ORM bulk-by-primary-key rules.
        stmt = (
            update(ApiKey)
            .where(
                and_(
                    ApiKey.id == bindparam("b_id"),
                    or_(
                        ApiKey.last_used_at.is_(None),
                        ApiKey.last_used_at < bindparam("b_time"),
                    ),
                )
            )
            .values(last_used_at=bindparam("b_time"))
        )
        params = [{"b_id": k, "b_time": t} for k, t in pending.items()]
        try:
            with self._session_factory.begin() as session:
                session.connection().execute(stmt, params)
        except Exception:
            with self._used_lock:
                for k, t in pending.items():
                    newer = self._last_used.get(k)
                    if newer is None or newer < t:
                        self._last_used[k] = t
            raise
        return len(pending)
