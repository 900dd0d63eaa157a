"""Domain errors raised by ``tenants``. ``app/`` maps them to HTTP in exactly one place.

Messages are safe to show to clients: they never contain salts, key secrets or key hashes.
"""

from __future__ import annotations

from typing import Literal

#: Why a token was rejected; for server-side logs and metrics only, never sent to the client
#: (telling "unknown key" from "wrong secret" would help an attacker enumerate key ids).
InvalidTokenReason = Literal["malformed", "unknown_key", "bad_secret", "revoked", "expired",
                             "bad_jwt", "unknown_tenant"]


class TenantError(Exception):
    """Base class of all tenant-domain errors."""


class TenantNotFound(TenantError):
    """No tenant with the given id or name exists (HTTP 404)."""


class ApiKeyNotFound(TenantError):
    """No API key with the given key id exists (HTTP 404)."""


class DuplicateTenant(TenantError):
    """A tenant with the given name already exists (HTTP 409)."""


class TenantDisabled(TenantError):
    """The tenant exists but is disabled; its credentials are refused (HTTP 403)."""


class InvalidToken(TenantError):
    """A bearer token is malformed, unknown, wrong, revoked or expired (HTTP 401).

    Attributes:
        reason: machine-readable cause, for logs only (see ``InvalidTokenReason``).
    """

    def __init__(self, reason: InvalidTokenReason, message: str = "invalid API key") -> None:
        super().__init__(message)
        self.reason: InvalidTokenReason = reason


class SaltDecryptionError(TenantError):
    """A stored salt failed to decrypt: wrong master key, or the ciphertext was tampered with or
    copied to another tenant/version (HTTP 500; an operator problem, never a client one)."""
