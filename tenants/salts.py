"""Tenant salts and the per-request effective salt that keys block 0 of the prefix cache.

Effective salt (32 bytes) = ``HMAC-SHA256(key=tenant_salt, msg)`` where ``msg`` is::

    b"saltserve/effective-salt/v1"          27 ASCII bytes, domain separation
    | u32be(version)                         the tenant salt version
    | 0x00                                   no client cache_salt        (message ends here), or
    | 0x01 | u32be(len(c)) | c               c = client cache_salt encoded as UTF-8

Every field is fixed-size or length-prefixed, so distinct inputs never share a message. Because
the tenant's secret salt is the HMAC key, a client ``cache_salt`` can only split one tenant's
namespace further (e.g. per end user); without the tenant salt nobody can produce, or collide
with, another tenant's effective salt.

Test vector: ``effective_salt(bytes(range(32)), 7, None).hex()`` ==
``37414221e5a067415eadc7eeb90e5967a3b59f13b1124841f627e2c989079ca4``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import struct
from typing import NoReturn

SALT_BYTES = 32
EFFECTIVE_SALT_DOMAIN = b"saltserve/effective-salt/v1"
MAX_CLIENT_CACHE_SALT_CHARS = 128


def new_salt() -> bytes:
    """Returns a new random tenant salt: 32 bytes (256 bits) from ``secrets``."""
    return secrets.token_bytes(SALT_BYTES)


def validate_client_cache_salt(cache_salt: str) -> str:
    """Checks a client-supplied ``cache_salt``.

    Args:
        cache_salt: the request's ``cache_salt`` field.

    Returns:
        ``cache_salt`` unchanged.

    Raises:
        ValueError: unless it has 1..128 characters and is encodable as UTF-8 (HTTP 400).
        TypeError: if it is not a str.
    """
    if not isinstance(cache_salt, str):
        raise TypeError("cache_salt must be a string")
    if not 1 <= len(cache_salt) <= MAX_CLIENT_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt must be 1 to {MAX_CLIENT_CACHE_SALT_CHARS} characters long")
    try:
        cache_salt.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("cache_salt must be valid Unicode text") from None
    return cache_salt


def effective_salt(tenant_salt: bytes, version: int, client_cache_salt: str | None) -> bytes:
    """Derives the salt that keys a request's block-0 hash (layout in the module docstring).

    Deterministic: equal inputs give equal outputs in any process.

    Args:
        tenant_salt: the tenant's secret salt (decrypted, usually 32 bytes).
        version: the tenant salt version, 0 <= version < 2**32.
        client_cache_salt: the request's optional ``cache_salt``, or None.

    Returns:
        32 bytes.

    Raises:
        ValueError: if ``tenant_salt`` is empty, ``version`` is out of range, or
            ``client_cache_salt`` fails ``validate_client_cache_salt``.
    """
    if not tenant_salt:
        raise ValueError("tenant salt must not be empty")
    if not 0 <= version < 2**32:
        raise ValueError(f"salt version out of range: {version}")
    msg = EFFECTIVE_SALT_DOMAIN + struct.pack(">I", version)
    if client_cache_salt is None:
        msg += b"\x00"
    else:
        client = validate_client_cache_salt(client_cache_salt).encode("utf-8")
        msg += b"\x01" + struct.pack(">I", len(client)) + client
    return hmac.new(tenant_salt, msg, hashlib.sha256).digest()


class SealedSalt:
    """A decrypted tenant salt that can only be used, never read back.

    The bytes stay inside this object: it has no accessor, its ``repr`` is redacted, it refuses
    to be pickled (copies return the same object), and equality is identity (sealed salts are
    never compared by value). ``tenants`` constructs it; everything else only calls ``derive``
    (through ``AuthContext.effective_salt``) or ``occurs_in`` (leak checks).

    Raises:
        ValueError: (constructor) if ``salt`` is empty or not bytes.
    """

    __slots__ = ("__salt",)

    def __init__(self, salt: bytes) -> None:
        if not isinstance(salt, bytes) or not salt:
            raise ValueError("a tenant salt must be non-empty bytes")
        self.__salt = salt

    def __repr__(self) -> str:
        return "SealedSalt(<redacted>)"

    def __reduce__(self) -> NoReturn:
        raise TypeError("a SealedSalt cannot be pickled")

    def __copy__(self) -> SealedSalt:
        return self  # immutable: copies share the one sealed value

    def __deepcopy__(self, memo: dict) -> SealedSalt:
        return self

    def derive(self, version: int, client_cache_salt: str | None = None) -> bytes:
        """Returns ``effective_salt(<this salt>, version, client_cache_salt)`` (32 bytes).

        Raises:
            ValueError: if ``version`` is out of range or ``client_cache_salt`` is invalid.
        """
        return effective_salt(self.__salt, version, client_cache_salt)

    def occurs_in(self, text: str | bytes) -> bool:
        """True if ``text`` contains this salt raw (bytes only), as hex, base64, URL-safe base64
        or its Python ``repr``. For leak checks (tests, audits); reveals nothing else.
        """
        salt = self.__salt
        forms = [salt.hex(), base64.b64encode(salt).decode(),
                 base64.urlsafe_b64encode(salt).decode(), repr(salt)]
        if isinstance(text, bytes):
            return salt in text or any(f.encode() in text for f in forms)
        return any(f in text for f in forms) or salt.hex().upper() in text
