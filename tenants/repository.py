"""``TenantRepository``: the only way the rest of saltserve reads or writes tenant data.

Returns plain frozen dataclasses (``tenants.records``, re-exported here), never ORM objects.
Salts are decrypted here and handed out only inside ``AuthContext`` (whose ``repr`` hides them);
they never reach logs or audit rows, which record the salt version only.

Thread-safe: every method opens its own short session; the in-memory salt cache and the
``last_used_at`` buffer are guarded by a lock.
"""

from __future__ import annotations

import threading
from datetime import datetime

from sqlalchemy import and_, bindparam, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from tenants.api_keys import generate_api_key, parse_api_key, verify_secret
from tenants.crypto import SaltCipher
from tenants.errors import (
    ApiKeyNotFound,
    DuplicateTenant,
    InvalidToken,
    TenantDisabled,
    TenantNotFound,
)
from tenants.models import ApiKey, Tenant, TenantSalt, new_tenant_id, require_aware, utcnow
from tenants.records import ApiKeyInfo, AuditEntry, AuthContext, TenantInfo, UsageRecord
from tenants.salts import new_salt
from tenants.usage import add_audit, add_usage_record, select_audit, select_usage

__all__ = [
    "UNCHANGED",
    "ApiKeyInfo",
    "AuditEntry",
    "AuthContext",
    "TenantInfo",
    "TenantRepository",
    "UsageRecord",
]

MAX_TENANT_NAME_CHARS = 255


class _Unchanged:
    """Type of ``UNCHANGED``: "keep the current value" where None means "unlimited"."""

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED = _Unchanged()
_KEY_ID_ATTEMPTS = 5  # 48-bit random key ids: a collision is already astronomically rare


def _tenant_info(row: Tenant) -> TenantInfo:
    return TenantInfo(
        id=row.id,
        name=row.name,
        disabled=row.disabled,
        current_salt_version=row.current_salt_version,
        enable_prefix_caching=row.enable_prefix_caching,
        created_at=row.created_at,
        rpm_limit=row.rpm_limit,
        tpm_limit=row.tpm_limit,
        max_concurrent=row.max_concurrent,
    )


def _key_info(row: ApiKey) -> ApiKeyInfo:
    return ApiKeyInfo(
        id=row.id,
        tenant_id=row.tenant_id,
        display_prefix=row.display_prefix,
        last4=row.last4,
        name=row.name,
        created_at=row.created_at,
        expires_at=row.expires_at,
        revoked_at=row.revoked_at,
    )


class TenantRepository:
    """Tenants, API keys, salts, usage and audit records over one database.

    Args:
        session_factory: from ``tenants.db.make_session_factory``.
        cipher: encrypts/decrypts salts at rest.
    """

    def __init__(self, session_factory: sessionmaker[Session], cipher: SaltCipher) -> None:
        self._session_factory = session_factory
        self._cipher = cipher
        self._lock = threading.Lock()
        self._salt_cache: dict[tuple[str, int], bytes] = {}  # (tenant_id, version) -> salt
        self._last_used: dict[str, datetime] = {}  # key_id -> latest use, not yet flushed

    def __repr__(self) -> str:
        return "TenantRepository(<redacted>)"

    # ------------------------------------------------------------------ tenants

    def create_tenant(
        self, name: str, *, enable_prefix_caching: bool = True, actor: str = "system"
    ) -> TenantInfo:
        """Creates a tenant with salt version 1.

        Args:
            name: unique display name, 1..255 chars after stripping whitespace.
            enable_prefix_caching: whether the tenant's requests use the prefix cache.
            actor: who did it, for the audit log.

        Returns:
            The new tenant.

        Raises:
            ValueError: if ``name`` is empty or too long.
            DuplicateTenant: if a tenant with this name exists.
        """
        name = name.strip() if isinstance(name, str) else ""
        if not 1 <= len(name) <= MAX_TENANT_NAME_CHARS:
            raise ValueError(f"tenant name must be 1 to {MAX_TENANT_NAME_CHARS} characters")
        tenant_id = new_tenant_id()
        salt = new_salt()
        now = utcnow()
        try:
            with self._session_factory.begin() as session:
                if session.scalar(select(Tenant.id).where(Tenant.name == name)) is not None:
                    raise DuplicateTenant(f"tenant {name!r} already exists")
                tenant = Tenant(
                    id=tenant_id,
                    name=name,
                    created_at=now,
                    disabled=False,
                    current_salt_version=1,
                    enable_prefix_caching=enable_prefix_caching,
                )
                session.add(tenant)
                session.flush()  # tenant row before its FK children
                session.add(
                    TenantSalt(
                        tenant_id=tenant_id,
                        version=1,
                        encrypted_salt=self._cipher.encrypt(tenant_id, 1, salt),
                        created_at=now,
                    )
                )
                add_audit(session, actor, "tenant.create", tenant_id, "salt_version=1")
                info = _tenant_info(tenant)
        except IntegrityError:  # lost a race with a concurrent create of the same name
            raise DuplicateTenant(f"tenant {name!r} already exists") from None
        with self._lock:
            self._salt_cache[(tenant_id, 1)] = salt
        return info

    def get_tenant(self, tenant_id: str) -> TenantInfo:
        """Returns a tenant by id.

        Raises:
            TenantNotFound: if there is no such tenant.
        """
        with self._session_factory() as session:
            row = session.get(Tenant, tenant_id)
            if row is None:
                raise TenantNotFound(f"tenant {tenant_id!r} not found")
            return _tenant_info(row)

    def get_tenant_by_name(self, name: str) -> TenantInfo:
        """Returns a tenant by its unique name.

        Raises:
            TenantNotFound: if there is no such tenant.
        """
        with self._session_factory() as session:
            row = session.scalar(select(Tenant).where(Tenant.name == name))
            if row is None:
                raise TenantNotFound(f"tenant {name!r} not found")
            return _tenant_info(row)

    def list_tenants(self) -> list[TenantInfo]:
        """Returns all tenants, oldest first."""
        with self._session_factory() as session:
            rows = session.scalars(select(Tenant).order_by(Tenant.created_at, Tenant.id))
            return [_tenant_info(r) for r in rows]

    def update_tenant(
        self,
        tenant_id: str,
        *,
        disabled: bool | None = None,
        enable_prefix_caching: bool | None = None,
        rpm_limit: int | None | _Unchanged = UNCHANGED,
        tpm_limit: int | None | _Unchanged = UNCHANGED,
        max_concurrent: int | None | _Unchanged = UNCHANGED,
        actor: str = "system",
    ) -> TenantInfo:
        """Changes a tenant's flags; None leaves a flag as it is.

        A disabled tenant's keys are refused (``TenantDisabled``) until it is enabled again.
        Limits (requests / tokens per minute, concurrent requests; enforced by ``app.limits``)
        take ``UNCHANGED`` (the default) to keep, None for unlimited, or an int >= 1; they apply
        from the tenant's next authenticated request.

        Raises:
            TenantNotFound: if there is no such tenant.
            ValueError: if a limit is not None, UNCHANGED or an int >= 1.
        """
        limits = {"rpm_limit": rpm_limit, "tpm_limit": tpm_limit,
                  "max_concurrent": max_concurrent}
        for name, value in limits.items():
            if value is not UNCHANGED and value is not None and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None (unlimited) or an integer >= 1")
        with self._session_factory.begin() as session:
            row = session.get(Tenant, tenant_id, with_for_update=True)
            if row is None:
                raise TenantNotFound(f"tenant {tenant_id!r} not found")
            changes = []
            if disabled is not None and disabled != row.disabled:
                row.disabled = disabled
                changes.append(f"disabled={disabled}")
            if (
                enable_prefix_caching is not None
                and enable_prefix_caching != row.enable_prefix_caching
            ):
                row.enable_prefix_caching = enable_prefix_caching
                changes.append(f"enable_prefix_caching={enable_prefix_caching}")
            for name, value in limits.items():
                if value is not UNCHANGED and value != getattr(row, name):
                    setattr(row, name, value)
                    changes.append(f"{name}={value}")
            if changes:
                add_audit(session, actor, "tenant.update", tenant_id, " ".join(changes))
            return _tenant_info(row)

    # ------------------------------------------------------------------ salts

    def rotate_salt(self, tenant_id: str, *, actor: str = "system") -> int:
        """Creates a new salt version and makes it current at once.

        Blocks cached under older versions become unreachable: new requests derive a different
        effective salt. Older salt rows are kept (encrypted) for the audit trail.

        Args:
            tenant_id: the tenant.
            actor: who did it, for the audit log (which records the version, never the salt).

        Returns:
            The new current salt version.

        Raises:
            TenantNotFound: if there is no such tenant.
        """
        salt = new_salt()
        with self._session_factory.begin() as session:
            row = session.get(Tenant, tenant_id, with_for_update=True)
            if row is None:
                raise TenantNotFound(f"tenant {tenant_id!r} not found")
            version = row.current_salt_version + 1
            session.add(
                TenantSalt(
                    tenant_id=tenant_id,
                    version=version,
                    encrypted_salt=self._cipher.encrypt(tenant_id, version, salt),
                    created_at=utcnow(),
                )
            )
            row.current_salt_version = version
            add_audit(session, actor, "tenant.rotate_salt", tenant_id, f"salt_version={version}")
        with self._lock:
            for cached in [k for k in self._salt_cache if k[0] == tenant_id]:
                del self._salt_cache[cached]
            self._salt_cache[(tenant_id, version)] = salt
        return version

    def reencrypt_salts(self, new_cipher: SaltCipher, *, actor: str = "system") -> int:
        """Re-encrypts every stored salt under a new master key (master-key rotation).

        Runs in one transaction; afterwards this repository uses ``new_cipher``. Restart other
        processes with the new master key once this returns.

        Returns:
            The number of salt rows re-encrypted.

        Raises:
            SaltDecryptionError: if a stored salt does not decrypt with the current key
                (nothing is changed).
        """
        with self._session_factory.begin() as session:
            rows = session.scalars(select(TenantSalt).with_for_update()).all()
            for row in rows:
                plain = self._cipher.decrypt(row.tenant_id, row.version, row.encrypted_salt)
                row.encrypted_salt = new_cipher.encrypt(row.tenant_id, row.version, plain)
            add_audit(session, actor, "master_key.rotate", None, f"salts={len(rows)}")
        self._cipher = new_cipher
        return len(rows)

    def _load_salt(self, session: Session, tenant_id: str, version: int) -> bytes:
        key = (tenant_id, version)
        with self._lock:
            cached = self._salt_cache.get(key)
        if cached is not None:
            return cached
        blob = session.scalar(
            select(TenantSalt.encrypted_salt).where(
                TenantSalt.tenant_id == tenant_id, TenantSalt.version == version
            )
        )
        assert blob is not None, f"tenant {tenant_id} has no salt row for version {version}"
        salt = self._cipher.decrypt(tenant_id, version, blob)
        with self._lock:
            self._salt_cache[key] = salt
        return salt

    def get_auth_context(self, tenant_id: str) -> AuthContext:
        """Builds an ``AuthContext`` for a tenant authenticated another way (e.g. a JWT).

        Raises:
            TenantNotFound: if there is no such tenant.
            TenantDisabled: if the tenant is disabled.
        """
        with self._session_factory() as session:
            row = session.get(Tenant, tenant_id)
            if row is None:
                raise TenantNotFound(f"tenant {tenant_id!r} not found")
            if row.disabled:
                raise TenantDisabled(f"tenant {tenant_id!r} is disabled")
            return AuthContext(
                tenant_id=row.id,
                tenant_name=row.name,
                key_id=None,
                salt_version=row.current_salt_version,
                tenant_salt=self._load_salt(session, row.id, row.current_salt_version),
                enable_prefix_caching=row.enable_prefix_caching,
                rpm_limit=row.rpm_limit,
                tpm_limit=row.tpm_limit,
                max_concurrent=row.max_concurrent,
            )

    # ------------------------------------------------------------------ API keys

    def create_api_key(
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
            ValueError: if ``expires_at`` is naive.
        """
        require_aware(expires_at, "expires_at")
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
                    return new.token, _key_info(row)
            except IntegrityError:
                if attempt == _KEY_ID_ATTEMPTS - 1:
                    raise
        raise AssertionError("could not draw an unused API key id")

    def revoke_api_key(self, key_id: str, *, actor: str = "system") -> ApiKeyInfo:
        """Revokes a key; it is refused from the next request on. Idempotent.

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
            return _key_info(row)

    def list_api_keys(self, tenant_id: str) -> list[ApiKeyInfo]:
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
            return [_key_info(r) for r in rows]

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
            version = tenant.current_salt_version
            ctx = AuthContext(
                tenant_id=tenant.id,
                tenant_name=tenant.name,
                key_id=key.id,
                salt_version=version,
                tenant_salt=self._load_salt(session, tenant.id, version),
                enable_prefix_caching=tenant.enable_prefix_caching,
                rpm_limit=tenant.rpm_limit,
                tpm_limit=tenant.tpm_limit,
                max_concurrent=tenant.max_concurrent,
            )
        with self._lock:
            previous = self._last_used.get(key.id)
            if previous is None or previous < now:
                self._last_used[key.id] = now
        return ctx

    def flush_last_used(self) -> int:
        """Writes buffered ``last_used_at`` times in one transaction (call periodically and at
        shutdown). A stored time is never moved backwards. On failure the buffer is kept.

        Returns:
            The number of keys written.

        Raises:
            sqlalchemy.exc.SQLAlchemyError: if the write fails (the times stay buffered).
        """
        with self._lock:
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
            with self._lock:
                for k, t in pending.items():
                    newer = self._last_used.get(k)
                    if newer is None or newer < t:
                        self._last_used[k] = t
            raise
        return len(pending)

    # ------------------------------------------------------------------ usage and audit

    def record_usage(self, record: UsageRecord) -> None:
        """Stores one request's usage (see ``tenants.usage.add_usage_record``).

        Raises:
            ValueError: if ``status`` is not "ok", "error" or "aborted", a token count is
                negative, or ``created_at`` is naive.
            sqlalchemy.exc.IntegrityError: if ``tenant_id`` does not exist.
        """
        with self._session_factory.begin() as session:
            add_usage_record(session, record)

    def list_usage(
        self,
        tenant_id: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int | None = None,
    ) -> list[UsageRecord]:
        """Returns usage records, oldest first; ``since`` inclusive, ``until`` exclusive.

        Raises:
            ValueError: if ``since`` or ``until`` is naive.
        """
        with self._session_factory() as session:
            return select_usage(session, tenant_id, since, until, limit)

    def audit(
        self,
        actor: str,
        action: str,
        tenant_id: str | None = None,
        detail: str | None = None,
        request_id: str | None = None,
    ) -> None:
        """Appends an audit record. Never pass a salt, key secret or key hash in ``detail``."""
        with self._session_factory.begin() as session:
            add_audit(session, actor, action, tenant_id, detail, request_id)

    def list_audit(self, tenant_id: str | None = None, limit: int = 100) -> list[AuditEntry]:
        """Returns the newest audit records first (at most ``limit``), optionally one tenant's."""
        with self._session_factory() as session:
            return select_audit(session, tenant_id, limit)
