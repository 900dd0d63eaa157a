"""``TenantRepository``: one facade over the ``tenants`` stores, for the CLI, bootstrap and tests.

It composes one object per concern, sharing one session factory and cipher:

- ``tenants``: ``TenantStore`` (tenant rows, salt rows: create, rotate, re-encrypt);
- ``keys``: ``ApiKeyStore`` (create, revoke, list API keys);
- ``authenticator``: ``Authenticator`` (API key or JWT tenant -> ``AuthContext``; salt cache;
  buffered ``last_used_at``);
- ``usage``: ``UsageStore`` (usage records and the audit log);
- ``revocations``: ``TokenRevocations`` (platform JWTs revoked by ``jti``).

Callers use those attributes (``repo.tenants.create(...)``, ``repo.keys.revoke(...)``); the
facade adds no methods of its own. Everything returns plain frozen dataclasses
(``tenants.records``, re-exported here), never ORM objects. Salts leave ``tenants`` only sealed
inside ``AuthContext``; logs and audit rows record salt versions only. Thread-safe (see each
part).
"""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from tenants.api_key_store import ApiKeyStore
from tenants.authenticator import Authenticator
from tenants.crypto import SaltCipher
from tenants.records import ApiKeyInfo, AuditEntry, AuthContext, TenantInfo, UsageRecord
from tenants.revocations import TokenRevocations
from tenants.tenant_store import MAX_TENANT_NAME_CHARS, UNCHANGED, TenantStore
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
        self.cipher = cipher
        self.authenticator = Authenticator(session_factory, cipher)
        self.tenants = TenantStore(session_factory, cipher, observer=self.authenticator)
        self.keys = ApiKeyStore(session_factory)
        self.usage = UsageStore(session_factory)
        self.revocations = TokenRevocations(session_factory)

    def __repr__(self) -> str:
        return "TenantRepository(<redacted>)"
